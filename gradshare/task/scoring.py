"""Scoring a replica on validation data after each epoch (validation.py): rank 0 on the in-memory
arrays, or every rank on its shard, the sums reduced over the barrier's allGather."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from gradshare.errors import TrainingError
from gradshare.reports import EpochStats
from gradshare.task.apply_log import ApplyLog
from gradshare.task.config import TrainStep, WorkerConfig
from gradshare.task.partition import PartitionData
from gradshare.task.profiling import Off, StepProfile
from gradshare.task.spill import SpilledPartition
from gradshare.task.validation import SCORE_BATCH_ROWS, as_mean, reduce_sums, shard_sums


class Scorer:
    """What one rank scores its replica on, and when."""

    def __init__(
        self, cfg: WorkerConfig, rank: int, model: nn.Module, train_step: TrainStep, device: torch.device
    ) -> None:
        self.cfg, self.rank, self.model, self.train_step, self.device = cfg, rank, model, train_step, device
        self.shard: PartitionData | SpilledPartition | None = None  # this rank's validation rows (cfg.data.shards)
        self.gather: Callable[[str], list[str]] | None = None  # the barrier's allGather: reduces shard scores

    @property
    def evaluates(self) -> bool:
        return self.cfg.data.validation is not None and self.rank == 0

    def shard_points(self, start_step: int) -> list[tuple[int, int]]:
        """Shards: every rank scores epoch e on the log through the step where the longest rank ends it
        (the same point, the same allGather calls in the same order on every rank, whatever each rank's
        steps per epoch); only the epochs this attempt reaches."""
        if not self.cfg.data.shards:
            return []
        ends = (max((e + 1) * spe for spe in self.cfg.data.steps_per_epoch) - 1 for e in range(self.cfg.data.epochs))
        return [(e, end) for e, end in enumerate(ends) if end >= start_step]

    def score(
        self,
        scores: deque[tuple[int, int]],
        upto: int,
        log: ApplyLog,
        history: list[EpochStats],
        profile: StepProfile | Off,
        closed: Callable[[EpochStats], None],
    ) -> None:
        """Score every epoch (entries (epoch, log step)) whose log step is <= `upto`, each on the log
        applied through its epoch's last step (every worker's messages, buffers included; the last
        epoch: the whole log, the model fit returns), then hand rank 0's scored row to `closed`. Called
        before each step with the step's own apply bound, so scoring never applies the log further than
        the step would: validation does not change what is trained."""
        while scores and scores[0][1] <= upto:
            epoch, through = scores.popleft()
            log.apply_through(through)
            if log.stop_epoch is not None and epoch > log.stop_epoch:
                continue  # shards: an epoch the stop cut; the log decides it alike on every rank
            value = self.evaluate()
            i = next((i for i in range(len(history) - 1, -1, -1) if history[i].epoch == epoch), None)
            if i is None:  # shards, a retried stage: this rank closed the epoch in an earlier attempt
                continue
            history[i] = history[i].scored(value)
            profile.score(i, value)
            if self.rank == 0:
                closed(history[i])

    def evaluate(self) -> float | None:
        """Rank 0's validation score of its replica as it is now (None elsewhere); with shards, every
        rank's shard sums reduced over all ranks (validation.py)."""
        cfg = self.cfg
        if cfg.data.shards:
            if self.gather is None:
                raise TrainingError(f"rank {self.rank} scores a validation shard with no allGather to reduce it")
            sums = shard_sums(
                self.model,
                self.train_step,
                self.shard,
                cfg.code.metric,
                cfg.data.label_dtype,
                max(SCORE_BATCH_ROWS, cfg.data.batch_size),
                self.device,
            )
            return reduce_sums(self.gather(json.dumps(sums)))
        if not self.evaluates or cfg.data.validation is None:  # (evaluates: validation is not None)
            return None
        inputs, yv = cfg.data.validation
        labels = torch.as_tensor(np.asarray(yv, dtype=cfg.data.label_dtype))
        batch = tuple(torch.as_tensor(a).to(self.device) for a in (*inputs, labels))
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            value = self.train_step.evaluate(self.model, batch, cfg.code.metric)
        self.model.train(was_training)
        return as_mean(value)
