"""A model whose Python worker dies once mid-training: the stage-retry tests share it."""

import os
import sys

from pyspark import cloudpickle
from torch import nn

from gradshare.demo import mlp

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module


class DiesOnce(nn.Module):
    """Rank `rank`'s Python worker calls os._exit on its `at`-th training forward of a task, on the
    first attempt only (the marker file says it happened; evaluation forwards are not counted)."""

    def __init__(self, marker, rank=1, at=30):
        super().__init__()
        self.net = mlp()
        self.marker, self.rank, self.at, self.calls = marker, rank, at, 0

    def forward(self, x):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.training and ctx is not None and ctx.partitionId() == self.rank:
            self.calls += 1
            if self.calls == self.at and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(17)
        return self.net(x)


class Slow(nn.Module):
    """The demo MLP whose every training forward sleeps `pause` s: a fit that lasts long enough for the
    driver to see a free slot (elastic tests)."""

    def __init__(self, pause):
        super().__init__()
        self.net, self.pause = mlp(), pause

    def forward(self, x):
        import time

        if self.training:
            time.sleep(self.pause)
        return self.net(x)
