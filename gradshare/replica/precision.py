"""Mixed precision: half-precision compute, float32 everything that is shared.

    precision = Precision("fp16-mixed", device_type="cpu")
    with precision.autocast():
        loss = loss_fn(model(x), y)
    precision.backward(loss)
    taken = precision.step(optimizer)      # False: a loss-scaler skip, the optimizer did not run

The names are Lightning's. "bf16-mixed" and "fp16-mixed" run the forward and the loss under
``torch.autocast`` with that dtype; the parameters stay float32 (they are views of the one float32
buffer the updates are encoded from, flat.py), so the gradients, the optimizer step, the residual, the
encode and the apply log are float32 exactly as with "32", and the replicas stay bit-identical.

fp16's narrow exponent underflows small gradients, so "fp16-mixed" scales the loss before backward
(``torch.amp.GradScaler``) and unscales the gradients before the optimizer step. When they hold
inf/NaN, the scaler skips the optimizer step and halves its scale: the step's update is zero, and the
worker sends an empty message for it (the apply log still advances). bf16 has float32's exponent range
and needs no scaler. The scaler's state is local to each worker, like the optimizer's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")


def check_precision(precision: object) -> str:
    """`precision` itself, or a ValueError naming the argument and the choices."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)} (Lightning's names), got {precision!r}"
        )
    return precision


def plain_step(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer step with nothing in between ("32", "bf16-mixed"): always taken."""
    optimizer.step()
    return True


class Precision:
    """The compute precision of one worker: a forward context, backward(loss) and step(optimizer).

    name: one of `PRECISIONS`. device_type: where the model computes ("cpu"), for autocast and the
    scaler. `skipped` counts the optimizer steps the loss scaler skipped (fp16-mixed only).
    """

    def __init__(self, name: str = "32", device_type: str = "cpu") -> None:
        self.name = check_precision(name)
        self.device_type = device_type
        self.dtype = {"32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[name]
        self.scaler = torch.amp.GradScaler(device_type) if name == "fp16-mixed" else None
        self.skipped = 0

    def autocast(self) -> AbstractContextManager[object]:
        """The context the forward and the loss run in."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Run the optimizer step (unscaled first under fp16-mixed); False when the scaler skipped it
        because the gradients held inf/NaN, in which case the optimizer wrote nothing."""
        if self.scaler is None:
            return plain_step(optimizer)
        before = self.scaler.get_scale()
        # Unscale first (torch's recipe for clipping under a scaler): a fused optimizer would otherwise
        # take the scale into its kernel, and a pre-step hook (losses.clip_grad_norm) would see the
        # gradients × 65536
        self.scaler.unscale_(optimizer)
        self.scaler.step(optimizer)
        self.scaler.update()
        after = self.scaler.get_scale()
        # The scaler lowers its scale (× backoff_factor, 0.5) exactly when it found inf/NaN, and then
        # does not run optimizer.step() (a fused optimizer gets found_inf and skips inside its kernel,
        # so asking the scale, not hooking optimizer.step, is what holds for both). A scale that has
        # fallen to 0 stays 0 and every step is skipped (0·loss unscales to NaN).
        taken = after >= before and after > 0.0
        self.skipped += not taken
        return taken
