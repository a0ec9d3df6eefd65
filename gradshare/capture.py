"""How a step's update gets into the residual: directly, when the optimizer allows it.

The general path measures the update as P_after − P_before against a twin copy of P (worker.py): it
works for any optimizer, but it costs a pass over P, the twin and the residual every step on top of
the optimizer's own pass, and it rounds each update to the precision of P (an update far below the
ulp of its weight is lost in P_after before it can be measured).

Most of torch's optimizers compute the amount they add to a parameter from its gradient and their
own state alone. For those the step can write straight into the residual: while ``optimizer.step()``
runs, each parameter's storage is pointed at its slice of the residual, so ``p.add_(delta)`` is
``r += delta``. P is not touched, nothing is rewound, and no twin is kept. Any optimizer that reads
the parameter's value (weight decay, or an unknown class) takes the general path.
"""

from __future__ import annotations

from contextlib import contextmanager

from gradshare.encoding import share_step
from gradshare.precision import plain_step
from gradshare.vectors import copy_into

# Exact classes (a subclass may override step). All of them read the parameter's value only for
# weight decay; AdamW's decoupled decay with weight_decay 0 multiplies by 1.0, which is exact.
_UPDATE_ONLY = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam")


def writes_update_only(optimizer) -> bool:
    """Whether ``optimizer.step()`` adds to each parameter an amount that does not depend on the
    parameter's value, so it may run with the parameters aliased to the residual."""
    import torch

    known = tuple(getattr(torch.optim, name) for name in _UPDATE_ONLY)
    if type(optimizer) not in known:
        return False
    return all(float(g.get("weight_decay", 0.0)) == 0.0 for g in optimizer.param_groups)


@contextmanager
def aliased(params, views):
    """Point each parameter's storage at the matching view for the duration (shapes must match),
    and back to what it was afterwards, also on error. The Parameter objects stay the same, so the
    optimizer's state keyed by them is untouched."""
    saved = [p.data for p in params]
    try:
        for p, v in zip(params, views):
            p.data = v
        yield
    finally:
        for p, v in zip(params, saved):
            p.data = v


class DirectPath:
    """The optimizer writes its update into the residual (`aliased`); P is never moved."""

    name = "direct"

    def __init__(self, flat, optimizer, residual) -> None:
        self.flat, self.optimizer = flat, optimizer
        self.views = flat.views(residual)

    def after_compute(self, changed_in_place: bool) -> None:
        """Nothing to keep: an in-place change of P by forward/backward stays in P (worker.py)."""

    def optimizer_step(self, run=plain_step) -> bool:
        """`run(optimizer)` takes the step and says whether it did (precision.py: a loss scaler may
        skip it); it runs inside the aliasing, so a skipped step leaves the residual untouched."""
        with aliased(self.flat.params, self.views):
            return run(self.optimizer)

    def encode(self, state, step: int):
        return share_step(state, step)


class GeneralPath:
    """Any optimizer: the update is measured as P_after − P_before against a twin copy of P, which the
    apply log keeps equal to P (FlatParams.keep_twin); the fused encode puts P_before back."""

    name = "general"

    def __init__(self, flat, optimizer) -> None:
        self.flat, self.optimizer = flat, optimizer
        flat.keep_twin()

    def after_compute(self, changed_in_place: bool) -> None:
        # Forward/backward changed a parameter in place outside the optimizer (a user bug). The change
        # stays in P (both copies), so the replica leaves the log and the fit's hash check names it,
        # instead of the change being shared as part of the update. (A write through p.data or a
        # NumPy alias is not seen here: it is shared as update, and replicas stay equal.)
        if changed_in_place:
            copy_into(self.flat.twin, self.flat.array)

    def optimizer_step(self, run=plain_step) -> bool:
        return run(self.optimizer)

    def encode(self, state, step: int):
        return share_step(state, step, update=self.flat.array, base=self.flat.twin, rewind=True)


def update_path(flat, optimizer, residual, allow_direct: bool = True):
    """The direct path where the optimizer allows it (and the caller does), else the general one."""
    if allow_direct and writes_update_only(optimizer):
        return DirectPath(flat, optimizer, residual)
    return GeneralPath(flat, optimizer)
