"""How a step's update gets into the residual: directly, when the optimizer allows it.

The general path measures the update as P_after − P_before against a twin copy of P (worker.py): it
works for any optimizer, but it costs a pass over P, the twin and the residual every step on top of
the optimizer's own pass, and it rounds each update to the precision of P (an update far below the
ulp of its weight is lost in P_after before it can be measured).

Most of torch's optimizers compute the amount they add to a parameter from its gradient and their
own state alone. For those the step can write straight into the residual: while ``optimizer.step()``
runs, each parameter's storage is pointed at its slice of the residual, so ``p.add_(delta)`` is
``r += delta``. P is not touched, nothing is rewound, and no twin is kept. Decoupled weight decay
(AdamW, and Adam, NAdam or RAdam with ``decoupled_weight_decay=True``: P ← P(1 − lr·λ) + u, Loshchilov &
Hutter 2019) reads P but only adds −lr·λ·P to the step's update: the optimizer runs with λ = 0 and the
path adds that term itself, reading P (`DecoupledDecay`), so the Hugging Face recipes' AdamW keeps the
direct path (GPT-2 small: the general path's twin and view cost 2 × 498 MB a worker). Any optimizer
that reads the parameter's value otherwise (L2 decay in the gradient, or an unknown class) takes the
general path.

Stepping in backward (memory). On the direct path the optimizer may also step each parameter
as soon as its gradient is ready, from a post-accumulate-grad hook, and drop that gradient at once
(PyTorch's "optimizer step in backward" recipe): a worker then never holds more than about one
layer's gradient instead of a gradient for every parameter (51.6 M-parameter MLP: the peak falls by
about half of P's bytes). The one optimizer steps once per parameter: the others hold no gradient at
that moment (they are None before their own hook and again after it), and torch's optimizers skip a
parameter without one. Every update this file allows is element-wise per parameter, so the update is
bit-identical to one step over all of them (tests/replica/test_capture_backward.py checks eleven optimizers).
It is not used, and the step runs after backward as before, when something needs every gradient at
once: a loss scaler (fp16-mixed: unscale and the inf/NaN check cover all gradients), a step hook on the
optimizer (e.g. losses.clip_grad_norm, which clips their total norm) or a global one, the general path,
or ``worker_options={"step_in_backward": False}``. Each per-parameter step costs an optimizer call
(~50 µs of Python on a CPU), so by default it is used only where it frees at least
IN_BACKWARD_MIN_BYTES (every gradient but the largest); ``{"step_in_backward": True}`` uses it
wherever it is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
from torch.optim import optimizer as torch_optimizer

from gradshare.encoding import Message, SharingState, share_step
from gradshare.replica.flat import FlatParams
from gradshare.replica.precision import Precision, plain_step
from gradshare.vectors import Vector, copy_into

# run(optimizer) -> whether the step was taken (precision.py: plain_step, Precision.step)
StepRunner = Callable[[torch.optim.Optimizer], bool]

# Exact classes (a subclass may override step). All of them read the parameter's value only for
# weight decay: none (λ = 0), or decoupled, which DecoupledDecay takes out of the step.
_UPDATE_ONLY = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam")


def _decoupled(group: dict[str, Any]) -> bool:
    """Whether the group's weight decay is decoupled: P(1 − lr·λ), not λ·P added to the gradient."""
    return bool(group.get("decoupled_weight_decay", False))


def writes_update_only(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` adds to each parameter an amount that does not depend on the
    parameter's value, once decoupled weight decay is taken out of it (`DecoupledDecay`), so it may run
    with the parameters aliased to the residual."""
    known = tuple(getattr(torch.optim, name) for name in _UPDATE_ONLY)
    if type(optimizer) not in known:
        return False
    return all(float(g.get("weight_decay", 0.0)) == 0.0 or _decoupled(g) for g in optimizer.param_groups)


class DecoupledDecay:
    """Decoupled weight decay taken out of the optimizer's step: the step runs with λ = 0 (`off`) and
    `add` puts −lr·λ·P into what the step wrote, P read from the replica's own parameters. The update
    is the optimizer's (u − lr·λ·P), rounded once in float32 instead of through P's own rounding of
    P(1 − lr·λ) (whose factor is itself rounded to float32: ulp(1) = 6e-8 against lr·λ = 1e-6)."""

    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer) -> None:
        self.groups = [g for g in optimizer.param_groups if float(g.get("weight_decay", 0.0)) != 0.0]
        # P, parameter by parameter (the flat buffer's slices, whatever the parameters alias meanwhile)
        self.shared = flat.views(flat.array)
        group_of = {id(p): g for g in self.groups for p in g["params"]}
        self.group_of = [group_of.get(id(p)) for p in flat.params]

    def __bool__(self) -> bool:
        return bool(self.groups)

    @contextmanager
    def off(self) -> Iterator[None]:
        """The optimizer's step with no decay of its own (λ put back afterwards, also on error)."""
        saved = [g["weight_decay"] for g in self.groups]
        try:
            for g in self.groups:
                g["weight_decay"] = 0.0
            yield
        finally:
            for g, wd in zip(self.groups, saved):
                g["weight_decay"] = wd

    def add(self, i: int, target: torch.Tensor) -> None:
        """target += −lr·λ·P for parameter i, at its group's lr as the step took it."""
        group = self.group_of[i]
        if group is not None:
            with torch.no_grad():
                target.add_(self.shared[i], alpha=-float(group["lr"]) * float(group["weight_decay"]))


@contextmanager
def aliased(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> Iterator[None]:
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


# Stepping in backward pays for its per-parameter optimizer calls (a 6-tensor 35 k-parameter MLP: +0.3 ms
# on a 1.2 ms step) only where it frees this much; the 51.6 M MLP of benchmarks/worker_memory.py frees 109 MB.
IN_BACKWARD_MIN_BYTES = 64 << 20


def frees_enough(flat: FlatParams) -> bool:
    """Whether stepping in backward frees at least IN_BACKWARD_MIN_BYTES: the bytes of every gradient
    but the largest (which is alive at its own step)."""
    sizes = [p.numel() * p.element_size() for p in flat.params]
    return bool(sum(sizes) - max(sizes) >= IN_BACKWARD_MIN_BYTES)


def needs_all_gradients(optimizer: torch.optim.Optimizer, precision: Precision) -> str | None:
    """Why this step must see every gradient at once (a short reason), or None when each parameter
    may be stepped in backward as its gradient is ready (module docstring)."""
    if getattr(precision, "scaler", None) is not None:
        return "a loss scaler unscales and checks all gradients"
    own = [getattr(optimizer, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    if any(h is None for h in own):  # an optimizer torch does not build this way: do not guess
        return "the optimizer's step hooks cannot be inspected"
    if any(own):
        return "the optimizer has a step hook (e.g. gradient clipping)"
    if any(
        getattr(torch_optimizer, name, None) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    ):
        return "a global optimizer step hook is registered"
    return None


class DirectPath:
    """The optimizer writes its update into the residual (`aliased`); P is never moved. With
    `in_backward`, each parameter's step runs from its gradient hook during backward (module docstring)."""

    name = "direct"

    def __init__(
        self,
        flat: FlatParams,
        optimizer: torch.optim.Optimizer,
        residual: Vector,
        in_backward: bool = False,
        folded: bool = False,
    ) -> None:
        """`residual`: the array the update is added to (the residual, or the folded view's point).
        `folded`: that array is also what forward/backward ran at (local_view.FoldedView)."""
        self.flat, self.optimizer = flat, optimizer
        self.views = flat.views(residual)
        self.decay = DecoupledDecay(flat, optimizer)
        self.in_backward = bool(in_backward)
        self.folded = bool(folded)
        self._armed = False  # hooks step only inside `backward`, never in a backward the worker did not start
        self.bumps = [0] * len(flat.params)  # version bumps of each parameter's own step in this backward
        if self.in_backward:
            for i, (p, v) in enumerate(zip(flat.params, self.views)):
                # torch leaves this method unannotated
                p.register_post_accumulate_grad_hook(self._hook_for(i, v))  # type: ignore[no-untyped-call]

    def _hook_for(self, i: int, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        unsafe_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)

        def step_now(p: torch.Tensor) -> None:
            if not self._armed:
                return
            version = p._version
            with aliased((p,), (view,)):
                with self.decay.off():
                    self.optimizer.step()  # only p has a gradient now: the others are skipped
                self.decay.add(i, view)
            if self.folded:
                # The step did change the values forward ran at: torch's version check stays, so a node
                # that saved p (or a detached alias) and runs later raises instead of reading new values;
                # the folded view discounts these bumps when it looks for a user's in-place change
                self.bumps[i] += p._version - version
            elif unsafe_set_version is not None:
                # P itself did not change (the step wrote into the residual): a node that saved P (or a
                # detached alias of it) and runs its backward later must not see it as modified
                unsafe_set_version((p,), (version,))
            p.grad = None

        return step_now

    def stepped(self) -> list[int]:
        """Version bumps of each parameter's own step in the last backward (folded view)."""
        return list(self.bumps)

    def backward(self, backward: Callable[[], None]) -> None:
        """Run `backward()` (the precision's loss.backward) with the per-parameter steps armed."""
        self.bumps = [0] * len(self.flat.params)
        self._armed = True
        try:
            backward()
        finally:
            self._armed = False

    def after_compute(self, changed_in_place: bool) -> None:
        """Nothing to keep: an in-place change of P by forward/backward stays in P (worker.py)."""

    def optimizer_step(self, run: StepRunner = plain_step) -> bool:
        """`run(optimizer)` takes the step and says whether it did (precision.py: a loss scaler may
        skip it); it runs inside the aliasing, so a skipped step leaves the residual untouched."""
        stepped = [p.grad is not None for p in self.flat.params]  # the optimizer skips the others
        with aliased(self.flat.params, self.views):
            with self.decay.off():
                taken = run(self.optimizer)
        if taken and self.decay:
            for i, view in enumerate(self.views):
                if stepped[i]:
                    self.decay.add(i, view)
        return taken

    def encode(self, state: SharingState, step: int) -> Message:
        return share_step(state, step)


class GeneralPath:
    """Any optimizer: the update is measured as P_after − P_before against a twin copy of P, which the
    apply log keeps equal to P (FlatParams.keep_twin); the fused encode puts P_before back."""

    name = "general"
    in_backward = False  # P_after must hold every parameter's step before the update is measured

    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer) -> None:
        self.flat, self.optimizer = flat, optimizer
        self.twin = flat.keep_twin()

    def after_compute(self, changed_in_place: bool) -> None:
        # Forward/backward changed a parameter in place outside the optimizer (a user bug). The change
        # stays in P (both copies), so the replica leaves the log and the fit's hash check names it,
        # instead of the change being shared as part of the update. (A write through p.data or a
        # NumPy alias is not seen here: it is shared as update, and replicas stay equal.)
        if changed_in_place:
            copy_into(self.twin, self.flat.array)

    def optimizer_step(self, run: StepRunner = plain_step) -> bool:
        return run(self.optimizer)

    def encode(self, state: SharingState, step: int) -> Message:
        return share_step(state, step, update=self.flat.array, base=self.twin, rewind=True)


def update_path(
    flat: FlatParams,
    optimizer: torch.optim.Optimizer,
    residual: Vector,
    allow_direct: bool = True,
    in_backward: bool = False,
    folded: bool = False,
) -> UpdatePath:
    """The direct path where the optimizer allows it (and the caller does), else the general one.
    `in_backward`: the direct path steps each parameter during backward (the caller has checked
    `needs_all_gradients`); the general path never does. `folded`: `residual` is the folded view's
    point (local_view.py), which needs the direct path."""
    if allow_direct and writes_update_only(optimizer):
        return DirectPath(flat, optimizer, residual, in_backward=in_backward, folded=folded)
    if folded:
        raise ValueError("the folded local view needs the direct update path")
    return GeneralPath(flat, optimizer)


UpdatePath: TypeAlias = DirectPath | GeneralPath
