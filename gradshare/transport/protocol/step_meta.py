"""What a rank says about its step beside the update (``StepMeta``): one frozen record, every field
optional, that crosses the wire inside the update's body (wire.py: ``u16 length | msgpack map | payload``).

Producers: the worker (its step's progress), rank 0's early stopping (task/stops.py: its epoch end and
stop request), the relay (its aggregate carries rank 0's stop epoch, relay/log.py). Consumers: the relay's
tallies (gradshare/task/tallies.py), every rank's apply log (task/apply_log.py: the stop epoch), the driver's progress
bar (reports.Progress). Nothing outside this module names a field by string.

On the wire the record is the msgpack map of float values it always was, one key per field that is set
(``{"loss": 0.25, "epoch": 1.0, ...}``); the whole-number fields travel as floats too. ``from_wire``
*rejects* a key it does not know (DecodeError naming it): both ends of a job run the same package, so an
unknown key is a malformed message, refused like any other, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gradshare.errors import DecodeError

MAX_WHOLE = 1 << 53  # the whole-number fields travel as floats: exact within ±2**53


@dataclass(frozen=True)
class StepMeta:
    """One step's message meta. Every rank's step sets its progress (loss .. lr); rank 0's message after
    an epoch's end adds that end's state (val_epoch .. stop_epoch, stopping.py); the relay's aggregate
    carries only rank 0's stop_epoch. Epochs count in this fit's log (0-based)."""

    # the step's progress (the relay tallies it per (rank, epoch), the driver's bar shows the latest)
    loss: float | None = None
    sparsity: float | None = None  # share of the entries the step sent
    bytes: float | None = None  # the step's payload
    epoch: int | None = None
    tau: float | None = None  # None: an fp16 step the loss scaler skipped (no τ was used)
    lr: float | None = None
    # rank 0's epoch end: its score (the relay keeps it for the epoch's row), early stopping's state
    val_epoch: int | None = None
    val_metric: float | None = None
    es_best: float | None = None
    es_waited: int | None = None
    stop_requested: int | None = None  # the epoch whose end asked for a stop
    stop_epoch: int | None = None  # the epoch every rank stops after (the log's decision)

    WHOLE: ClassVar[frozenset[str]] = frozenset({"epoch", "val_epoch", "es_waited", "stop_requested", "stop_epoch"})
    # what a new attempt inherits from the log before it (tallies.AttemptNotes, WELCOME's notes)
    NOTE_FIELDS: ClassVar[tuple[str, ...]] = ("es_best", "es_waited", "stop_epoch", "stop_requested")

    def __post_init__(self) -> None:
        # numbers as the producers have them (a NumPy float τ, an int epoch) are kept as the field's type
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"StepMeta.{f.name} must be a number (got {value!r})")
            if f.name in self.WHOLE:
                if not isinstance(value, numbers.Integral) or not -MAX_WHOLE <= int(value) <= MAX_WHOLE:
                    raise ValueError(f"StepMeta.{f.name} must be a whole number in [-2**53, 2**53] (got {value!r})")
                object.__setattr__(self, f.name, int(value))
            else:
                object.__setattr__(self, f.name, float(value))

    def with_(self, other: StepMeta) -> StepMeta:
        """This record with every field `other` sets taken from `other`."""
        return dataclasses.replace(
            self, **{f.name: v for f in dataclasses.fields(other) if (v := getattr(other, f.name)) is not None}
        )

    def to_wire(self) -> dict[str, float]:
        """The msgpack map: one float per field that is set."""
        return {f.name: float(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_wire(cls, fields: object) -> StepMeta:
        """The record of a decoded map; anything but a map of known names to floats (whole numbers where
        the field is one) raises DecodeError saying which entry is wrong."""
        if not isinstance(fields, dict):
            raise DecodeError(f"meta is not a map (got {type(fields).__name__})")
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}  # a float or an int by field: the constructor checks each once more
        for name, value in fields.items():
            if not isinstance(name, str) or name not in known:
                raise DecodeError(f"meta has an unknown entry {name!r}")
            if type(value) is not float:  # noqa: E721 - msgpack floats only, as the wire always held
                raise DecodeError(f"meta entry {name!r} is not a float (got {value!r})")
            if name in cls.WHOLE:
                if not (value.is_integer() and -MAX_WHOLE <= value <= MAX_WHOLE):
                    raise DecodeError(f"meta entry {name!r} is not a whole number in [-2**53, 2**53] (got {value!r})")
                values[name] = int(value)
            else:
                values[name] = value
        return cls(**values)

    def notes(self) -> dict[str, float]:
        """The fields a new attempt inherits (NOTE_FIELDS) that this record sets, by name (WELCOME's notes)."""
        return {k: v for k, v in self.to_wire().items() if k in self.NOTE_FIELDS}

    @classmethod
    def from_notes(cls, notes: Iterable[tuple[str, float]] | Mapping[str, float]) -> StepMeta:
        """The inherited fields among WELCOME's (name, value) notes; the others (a checkpoint) are not meta."""
        pairs = notes.items() if isinstance(notes, Mapping) else notes
        return cls.from_wire({k: float(v) for k, v in pairs if k in cls.NOTE_FIELDS})


__all__ = ["StepMeta"]
