"""A rank's batches: its partition, shuffled per epoch with a seeded order, as tensors on its device."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from gradshare.task.config import WorkerConfig
from gradshare.task.partition import PartitionData, epoch_order
from gradshare.task.spill import SpilledPartition


class BatchReader:
    """Batch b of epoch e of rank `rank`'s partition: (x1, ..., xn, labels) on `device`."""

    def __init__(
        self, cfg: WorkerConfig, rank: int, data: PartitionData | SpilledPartition, device: torch.device
    ) -> None:
        self.cfg, self.rank, self.data, self.device = cfg, rank, data, device
        self._order = np.empty(0, dtype=np.int64)
        self._order_epoch = -1
        self.labels: torch.Tensor | None
        if isinstance(data, SpilledPartition):  # its labels stay in the spill file; each batch reads its own (spill.py)
            self.labels = None
        elif len(data.labels) and cfg.data.label_dtype == "int64":
            self.labels = torch.from_numpy(np.ascontiguousarray(data.labels, dtype=np.int64))
        else:
            self.labels = torch.from_numpy(np.ascontiguousarray(data.labels, dtype=np.float32))

    def read(self, epoch: int, b: int) -> tuple[torch.Tensor, ...]:
        data, all_labels, cfg = self.data, self.labels, self.cfg
        if all_labels is None or isinstance(data, SpilledPartition):  # spilled: read in bounded shuffle
            # windows, in their own order (spill.py)
            spilled = cast(SpilledPartition, data)
            *inputs, labels = spilled.batch(epoch, b, cfg.data.batch_size, cfg.data.seed, self.rank)
            labels = labels.astype(np.int64 if cfg.data.label_dtype == "int64" else np.float32, copy=False)
            return tuple(torch.from_numpy(a).to(self.device) for a in (*inputs, labels))
        if b == 0 or self._order_epoch != epoch:
            self._order = epoch_order(len(data), cfg.data.seed, self.rank, epoch)
            self._order_epoch = epoch
        idx = np.sort(self._order[b * cfg.data.batch_size : (b + 1) * cfg.data.batch_size])
        # every input keeps its dtype (int64 token ids stay exact; batches.py)
        tensors = (torch.from_numpy(np.ascontiguousarray(a[idx])).to(self.device) for a in data.inputs)
        return (*tensors, all_labels[torch.from_numpy(idx)].to(self.device))
