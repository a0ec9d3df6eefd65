"""One epoch's running totals on a rank, closed into its history row (reports.EpochStats)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gradshare.reports import Counters, EpochStats
from gradshare.transport import Peer


def current_lr(optimizer: torch.optim.Optimizer) -> float | None:
    """The learning rate of the optimizer's first parameter group (None if it has none): the rate the
    sharing state follows (a scheduler scales every group alike)."""
    lr = optimizer.param_groups[0].get("lr")
    if lr is None:
        return None
    return float(lr.item() if hasattr(lr, "item") else lr)  # a tensor lr (capturable Adam) too


@dataclass
class EpochTally:
    """The steps of an epoch so far: their loss, entries and payload, and the peer's byte counters at its start."""

    out0: int  # bytes sent before the epoch
    in0: int  # training bytes received before it
    t0: float = field(default_factory=time.monotonic)
    loss: float = 0.0
    entries: int = 0
    payload: int = 0
    steps: int = 0
    silent: int = 0
    lr: float | None = None  # at the epoch's first step

    @classmethod
    def start(cls, peer: Peer) -> EpochTally:
        c = Counters.from_dict(peer.counters())
        return cls(out0=c.bytes_sent, in0=c.training_bytes_in)

    def add(self, loss: float, entries: int, payload: int) -> None:
        self.loss += loss
        self.entries += entries
        self.payload += payload
        self.steps += 1
        self.silent += entries == 0

    def close(self, peer: Peer, epoch: int, n_params: int, tau: float | None) -> EpochStats:
        """The epoch's row; `tau`: the last encoded step's τ."""
        c = Counters.from_dict(peer.counters())
        steps = max(self.steps, 1)
        return EpochStats(
            epoch=epoch,
            steps=self.steps,
            loss=self.loss / steps,
            sparsity=self.entries / (steps * n_params),
            payload_bytes=self.payload,
            bytes_sent=c.bytes_sent - self.out0,
            bytes_received=c.training_bytes_in - self.in0,
            tau=tau,
            lr=self.lr,
            silent_steps=self.silent,
            seconds=time.monotonic() - self.t0,
            val_metric=None,  # set by scoring: the score of the log through the epoch's end
        )
