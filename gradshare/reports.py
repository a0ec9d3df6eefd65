"""What crosses a process boundary as a report: frozen dataclasses in one module.

    WorkerReport    what a training task returns to the driver (through Spark's result channel)
    EpochStats      one history row: a rank's epoch (worker) or every rank's (the driver's merged row)
    Progress        a worker's step for the driver's progress bar (from its message's StepMeta)
    Counters        a peer's or the relay's transport counters, taken once at the boundary
    WorkerFailure   a worker's error: its class (by name), rank, step and first cause, so the driver
                    raises the class the worker raised

They replace dicts with string keys that worker.py, trainer.py and bench/* shared. Reports cross Spark
pickled (Spark's own channel, not our UDP wire: plain dataclasses of numbers, strings and arrays).
A step's meta (transport/protocol/step_meta.StepMeta) and a WorkerFailure cross OUR wire as the msgpack
fields they always had (StepMeta.to_wire, transport.events.Fail): nothing here is pickled onto the UDP port.

Reports and history rows keep dict-style read access (``report["rank"]``, ``row.get("val_metric")``,
``dict(row)``, ``"profile" in report``): FitResult.worker_reports, the rows on_epoch_end and
early_stopping see, and the docs' examples read them that way. An optional field left at None is absent
from that view, as the key was from the dict.

The transport cores keep counting in plain Counter dicts: one increment per datagram on the hot path,
and the counter set differs between the peer and the relay and grows with every drop reason. A
`Counters` is built from such a dict where it leaves the core for good (a worker's report, a fit's
result), not per datagram.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gradshare import errors
from gradshare.transport.protocol.step_meta import StepMeta

if TYPE_CHECKING:
    from gradshare.transport.protocol.events import Incident

# ----------------------------------------------------------------------------------- dict-style access


class _ReadAsMapping(Mapping[str, Any]):
    """Read-only dict view of a frozen dataclass's fields (see the module docstring). `OPTIONAL` fields
    are absent while None; `_extra` names a field of more keys merged into the view."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    _extra: ClassVar[str | None] = None

    def _keys(self) -> list[str]:
        names = [
            f.name
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.name != self._extra and not (f.name in self.OPTIONAL and getattr(self, f.name) is None)
        ]
        if self._extra is not None:
            names += [k for k in getattr(self, self._extra) if k not in names]
        return names

    def __getitem__(self, key: str) -> Any:
        if (
            key != self._extra
            and key in self._field_names()
            and not (key in self.OPTIONAL and getattr(self, key) is None)
        ):
            return getattr(self, key)
        if self._extra is not None:
            extra: Mapping[str, Any] = getattr(self, self._extra)
            if key in extra:
                return extra[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def as_dict(self) -> dict[str, Any]:
        """A plain dict of the view (shallow): JSON, MLflow, ``{**row, ...}``."""
        return {k: self[k] for k in self._keys()}

    @classmethod
    def _field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- counters


@dataclass(frozen=True, eq=False)
class Counters(_ReadAsMapping):
    """A peer's or the relay's transport counters at one moment (Peer.counters / Relay.counters).

    The fields every endpoint counts are typed; the role's own counters (a peer's updates_sent,
    delivered, unacked; the relay's forwarded, applied, aggregates, gone, ...) are in `other`, and
    read like the typed ones: ``counters["applied"]``, ``counters.get("gone", 0)``."""

    datagrams_in: int = 0
    datagrams_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    snapshot_bytes_in: int = 0  # a peer's model downloads from the relay (0 for the relay)
    retransmits: int = 0
    naks_sent: int = 0
    complete_through: int = -1
    drops: Mapping[str, int] = field(default_factory=dict)  # reason -> datagrams dropped
    other: Mapping[str, int] = field(default_factory=dict)

    _extra: ClassVar[str | None] = "other"
    _TYPED: ClassVar[tuple[str, ...]] = (
        "datagrams_in",
        "datagrams_out",
        "bytes_in",
        "bytes_out",
        "snapshot_bytes_in",
        "retransmits",
        "naks_sent",
        "complete_through",
    )

    @classmethod
    def from_dict(cls, counters: Mapping[str, Any]) -> Counters:
        """From a core's counter dict (PeerCore/RelayCore `counters()`); unknown keys go to `other`."""
        typed = {k: int(counters[k]) for k in cls._TYPED if k in counters}
        drops = {str(k): int(v) for k, v in dict(counters.get("drops") or {}).items()}
        other = {str(k): int(v) for k, v in counters.items() if k not in cls._TYPED and k != "drops"}
        return cls(**typed, drops=drops, other=other)

    @property
    def bytes_sent(self) -> int:
        """UDP bytes sent (datagrams incl. headers, acks, retransmits)."""
        return self.bytes_out

    @property
    def training_bytes_in(self) -> int:
        """UDP bytes received for training: without the model's snapshot downloads (the initial weights
        every worker fetches from the relay, or a resumed attempt's state), which the Spark job closure
        carried before and which are reported apart (`FitResult.snapshot_bytes`)."""
        return self.bytes_in - self.snapshot_bytes_in


@dataclass(frozen=True, eq=False)
class RelayResult:
    """The relay's end state, as the driver reads it from the relay it runs, or from rank 0's report when
    the relay ran inside the job (task/relay_host.py): the parameters (then float buffers), their hash,
    the counters, the log's (rank, epoch) tallies, its incidents and the checkpoints it rolled back to."""

    params: np.ndarray
    param_hash: str
    counters: Counters
    tallies: Mapping[tuple[int, int], Mapping[str, float | None]]
    incidents: tuple[Incident, ...]
    rolled_back: tuple[Mapping[str, int], ...]


# ----------------------------------------------------------------------------------- history rows


@dataclass(frozen=True, eq=False)
class EpochStats(_ReadAsMapping):
    """One epoch's history row. A worker's row covers its own steps; the driver merges every rank's into
    the row `FitResult.history` holds (as a plain dict, `as_dict`), which adds resumed, skipped_steps and
    loss_fn (absent from a worker's row, as before)."""

    epoch: int
    steps: int
    loss: float  # mean over the steps
    sparsity: float  # mean share of the entries sent
    payload_bytes: int
    bytes_sent: int
    bytes_received: int
    tau: float | None  # the last encoded step's τ (the merged row: the ranks' mean, NaN without one)
    lr: float | None  # at the epoch's first step
    silent_steps: int
    seconds: float
    val_metric: float | None = None  # the score of the log through the epoch's end, once scored
    resumed: bool | None = None  # the driver's: the epoch's steps span stage attempts
    skipped_steps: int | None = None  # the driver's: steps of data the log went on without
    loss_fn: str | None = None  # the driver's: the loss's name
    workers: int | None = None  # the driver's, in an elastic fit: the workers that trained the epoch

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"resumed", "skipped_steps", "loss_fn", "workers"})

    def scored(self, value: float | None) -> EpochStats:
        return dataclasses.replace(self, val_metric=value)


# ----------------------------------------------------------------------------------- worker report


@dataclass(frozen=True, eq=False)
class WorkerReport(_ReadAsMapping):
    """What one training task returns to the driver: the fit's result keeps one per rank."""

    rank: int
    start_step: int  # where this attempt started (a retried stage: the relay's step)
    last_step: int
    stopped_epoch: int | None  # early stop: the last epoch every rank ran (None: every epoch ran)
    stop_requested_epoch: int | None  # rank 0: the epoch whose end asked for a stop
    history: tuple[EpochStats, ...]
    applied: int  # messages the apply log applied
    train_seconds: float
    steps_run: int
    update_path: str  # capture.py: "direct" or "general"
    step_in_backward: bool
    device: str  # where it trained: "cpu", "cuda:0", ...
    tensor_state: bool  # the torch state (always on a GPU; vectors.py)
    silent_steps: int
    int_buffers: Mapping[str, np.ndarray]  # rank 0's integer buffers (BatchNorm's num_batches_tracked)
    skipped_steps: int  # optimizer steps the fp16 loss scaler skipped
    checkpoint_seconds: float
    profile: Mapping[str, Any] | None = None  # worker_options={"profile": True}: profiling.py's report
    # added by the task after the training loop (worker._run, train_partition)
    snapshot_seconds: float = 0.0
    param_hash: str = ""
    counters: Counters = field(default_factory=Counters)
    spilled: bool = False
    validation_rows: int | None = None  # validation shards only
    validation_spilled: bool | None = None
    attempt: int = 0
    pid: int = 0
    package: str = ""  # the directory gradshare was imported from in the task
    start_rss_bytes: int = 0
    peak_rss_bytes: int = 0
    relay: RelayResult | None = None  # rank 0 with the relay in the job: the relay's end state

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"profile", "validation_rows", "validation_spilled", "relay"})

    def with_(self, **changes: Any) -> WorkerReport:
        """A copy with `changes` (the task adds what it learns after the loop)."""
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------- progress


@dataclass(frozen=True)
class EpochLine:
    """One finished epoch as the progress bar prints it: the mean loss over every rank's steps of the
    epoch in the applied log, and rank 0's score of it once it came (None before, or without one)."""

    epoch: int  # counted in the log (a resumed fit adds its first epoch when it prints)
    loss: float
    val_metric: float | None


def epoch_lines(
    tallies: Mapping[tuple[int, int], Mapping[str, Any]], steps_per_epoch: tuple[int, ...], last: int = 8
) -> list[EpochLine]:
    """The last `last` epochs every rank has finished in the applied log (each rank's tally holds its
    steps_per_epoch steps), from the relay's (rank, epoch) tallies (gradshare/task/tallies.py)."""
    lines = []
    for epoch in sorted({e for _, e in tallies}):
        rows = [tallies.get((rank, epoch)) for rank in range(len(steps_per_epoch))]
        if any(row is None or int(row["steps"]) < steps_per_epoch[rank] for rank, row in enumerate(rows)):
            continue
        steps = sum(int(row["steps"]) for row in rows if row is not None)
        loss = sum(float(row["loss"]) for row in rows if row is not None) / max(steps, 1)
        score = rows[0]["val_metric"] if rows[0] is not None else None
        lines.append(EpochLine(epoch, loss, None if score is None else float(score)))
    return lines[-last:]


@dataclass(frozen=True)
class Progress:
    """A worker's step as the driver's progress bar shows it: the progress fields of the step's message
    meta (transport/protocol/step_meta.StepMeta, which the relay tallies per (rank, epoch))."""

    loss: float
    sparsity: float  # share of the entries the step sent
    bytes: float  # the step's payload
    epoch: float  # the step's epoch in this fit's log (0-based)
    tau: float | None = None  # None: an fp16 step the loss scaler skipped (no τ was used)
    lr: float | None = None

    @classmethod
    def from_meta(cls, meta: StepMeta | Mapping[str, object] | None) -> Progress | None:
        """The step summary in a message's meta, the record or its wire map (a relay's progress() holds
        the map); None when it carries none (a relay-made aggregate) or the map is not a StepMeta's."""
        if meta is not None and not isinstance(meta, StepMeta):
            try:
                meta = StepMeta.from_wire(dict(meta))
            except errors.DecodeError:
                return None
        if meta is None or meta.loss is None or meta.sparsity is None or meta.bytes is None:
            return None
        return cls(meta.loss, meta.sparsity, meta.bytes, float(meta.epoch or 0), meta.tau, meta.lr)


# ----------------------------------------------------------------------------------- failures

# A user's (or torch's) exception class cannot be imported on the driver in general. These builtins
# keep their class (what the driver raised before reports were typed); any other non-gradshare error arrives as
# TrainingError, its message naming the worker's exception type.
_KEPT_BUILTINS: Mapping[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}
_KEPT_BY_NAME = {"InputTypeError": "TypeError"}  # losses.InputTypeError: a TypeError the driver can raise
MAX_CAUSE_TEXT = 300


def error_class_name(exc: BaseException) -> str:
    """The class the driver raises for `exc`: its nearest class in gradshare.errors, else ValueError or
    TypeError where it is exactly one of those (or InputTypeError), else TrainingError."""
    for cls in type(exc).__mro__:
        found: str = cls.__name__
        if cls.__module__ == errors.__name__ and getattr(errors, found, None) is cls:
            return found
    name = type(exc).__name__
    name = _KEPT_BY_NAME.get(name, name)
    return name if name in _KEPT_BUILTINS else "TrainingError"


def resolve_error_class(name: str) -> type[Exception]:
    """The class named by `error_class_name` (a name off the wire: anything else is TrainingError)."""
    found = getattr(errors, name, None) if name in errors.__all__ else _KEPT_BUILTINS.get(name)
    return found if isinstance(found, type) and issubclass(found, Exception) else errors.TrainingError


def first_cause(exc: BaseException) -> str:
    """ "Type: message" of the innermost exception of `exc`'s chain (explicit causes first), bounded."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        exc = nxt
    return f"{type(exc).__name__}: {exc}"[:MAX_CAUSE_TEXT]


# the text form's tag: "[gradshare rank R, step S, Class] Type: message" (old tags: "[gradshare rank R]")
_TAG = re.compile(r"\[gradshare rank (\d+)(?:, step (-?\d+), (\w+))?\] ([\w.]+): ([^\n]*)")


@dataclass(frozen=True)
class WorkerFailure:
    """A worker's error as the driver learns it: plain fields, so it pickles and unpickles anywhere
    without the user's code, and goes over the relay's control channel as msgpack (events.Fail)."""

    rank: int
    step: int | None  # the step the rank was in (None: before its first step, e.g. reading its rows)
    error_type: str  # the worker's exception type as raised: "ValueError", "ModuleNotFoundError", ...
    message: str
    error_class: str = "TrainingError"  # the class the driver raises (`error_class_name`)
    cause: str | None = None  # the first cause of the chain ("Type: message"), when there is a chain
    attempt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {self.rank!r}")
        if self.step is not None and (not isinstance(self.step, int) or self.step < 0):
            raise ValueError(f"step must be None or an int >= 0, got {self.step!r}")
        if not self.error_type or not self.error_class:
            raise ValueError("error_type and error_class must name a class")

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int, step: int | None, attempt: int = 0) -> WorkerFailure:
        root = first_cause(exc)
        top = f"{type(exc).__name__}: {exc}"[:MAX_CAUSE_TEXT]
        return cls(
            rank, step, type(exc).__name__, str(exc), error_class_name(exc), None if root == top else root, attempt
        )

    def describe(self) -> str:
        """What the driver's error says: rank, the worker's type and message, and the first cause."""
        text = f"worker rank {self.rank} failed: {self.error_type}: {self.message}"
        return text if self.cause is None else f"{text} (first cause: {self.cause})"

    def error(self, prefix: str = "", cls: type[Exception] | None = None) -> Exception:
        """The exception the driver raises: of `error_class` (or `cls`), with rank, step and cause as
        attributes (and this record as `worker_failure`)."""
        exc = (cls or resolve_error_class(self.error_class))(prefix + self.describe())
        # plain attributes: on a gradshare class they are declared (errors.GradshareError), on the
        # builtins the driver keeps (ValueError, TypeError) they are set the same way
        for name, value in (("rank", self.rank), ("step", self.step), ("cause", self.cause), ("worker_failure", self)):
            setattr(exc, name, value)
        return exc

    # --- the text form: the fallback when only Spark's job error text reaches the driver ---------------
    def to_text(self) -> str:
        """One tagged line (the message of the TrainingError the task raises), then the record as JSON
        on the next, so the driver can rebuild it from Spark's text."""
        step = -1 if self.step is None else self.step
        tag = f"[gradshare rank {self.rank}, step {step}, {self.error_class}]"
        head = f"{tag} {self.error_type}: {_one_line(self.message)}"
        return f"{head}\n{FAILURE_JSON}{json.dumps(dataclasses.asdict(self), separators=(',', ':'))}"

    @classmethod
    def from_text(cls, text: str) -> WorkerFailure | None:
        """The last failure tagged in `text` (Spark's job error): the JSON record when present and
        whole, else the tag line alone (no cause; an older tag without step and class: the class by
        the type's name). None when nothing is tagged."""
        at = text.rfind(FAILURE_JSON)
        if at >= 0:
            line = text[at + len(FAILURE_JSON) :].split("\n", 1)[0]
            found = _from_json(line)
            if found is not None:
                return found
        tags = _TAG.findall(text)
        if not tags:
            return None
        rank, step, klass, kind, message = tags[-1]
        if not klass:
            short = kind.rsplit(".", 1)[-1]
            klass = short if short in errors.__all__ else _KEPT_BY_NAME.get(short, short)
        return cls(
            int(rank),
            None if not step or int(step) < 0 else int(step),
            kind.rsplit(".", 1)[-1],
            message,
            klass if klass in errors.__all__ or klass in _KEPT_BUILTINS else "TrainingError",
        )


FAILURE_JSON = "gradshare-failure: "


def _one_line(text: str) -> str:
    return text.replace("\n", " ")


def _from_json(line: str) -> WorkerFailure | None:
    try:
        d = json.loads(line)
    except ValueError:
        return None  # cut or mangled by the way Spark printed it: the tag line is the fallback
    if not isinstance(d, dict) or set(d) != {f.name for f in dataclasses.fields(WorkerFailure)}:
        return None
    ints = (d["rank"], d["attempt"])
    texts = (d["error_type"], d["message"], d["error_class"])
    if not all(isinstance(v, int) for v in ints) or not all(isinstance(v, str) for v in texts):
        return None
    if not (d["step"] is None or isinstance(d["step"], int)) or not (d["cause"] is None or isinstance(d["cause"], str)):
        return None
    if resolve_error_class(d["error_class"]).__name__ != d["error_class"]:
        d["error_class"] = "TrainingError"  # not a class the driver raises by name
    try:
        return WorkerFailure(**d)
    except ValueError:
        return None


__all__ = [
    "Counters",
    "EpochStats",
    "Progress",
    "WorkerFailure",
    "WorkerReport",
    "error_class_name",
    "first_cause",
    "resolve_error_class",
]
