"""Control messages on the wire and events out of the protocol cores: small frozen dataclasses.

Messages are validated in their constructors, so a decoded message is a valid one (h11 ``_events.py``,
aioquic ``quic/events.py``). Their byte codecs live in :mod:`gradshare.transport.protocol.wire`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradshare.transport.protocol.step_meta import StepMeta

if TYPE_CHECKING:  # for annotations only: this module needs no numpy at run time
    import numpy as np
    from numpy.typing import NDArray

# Ranks travel as u16 (0xFFFF is the relay). 1024, not more: per-rank forwarding sends N·(N−1) updates a
# step, so beyond a few hundred ranks the relay's egress, not this bound, is the limit.
MAX_WORLD_SIZE = 1024
# A STATUS lists ranks in pages of at most this many (one datagram each): worst case
# 64 × (5-byte have + 11-byte ended entry) + framing ≈ 1.05 kB fits a 1400-byte datagram
STATUS_PAGE_RANKS = 64
MAX_STEP = (1 << 32) - 2  # steps travel as uint32; -1 means "none"
# The origin of the relay's aggregated message of a step (forwarding="aggregate"): one
# past the largest rank, so it sorts after every rank of a step and never names one
AGGREGATE_ORIGIN = MAX_WORLD_SIZE
MAX_NAK_ITEMS = 64
MAX_NOTES = 16  # WELCOME: (name, value) notes an attempt inherits
MAX_ERROR_TYPE = 100  # FAIL: an exception's qualified class name
MAX_ERROR_TEXT = 300  # FAIL: the message, cut to this (and to what fits one datagram)

# Where a datagram came from or goes is the I/O shell's business: the cores keep one per rank and hand it
# back beside each datagram to send. The UDP shells use socket addresses ((host, port) tuples), the
# in-memory link (memory.py, tests/harness.py) ranks and names.
Address = Hashable
# What the cores' counters() return: counts by name, and "drops": reason -> count
Counters = dict[str, int | dict[str, int]]


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:  # noqa: E721 - bool is not an int here
        raise ValueError(f"{name} must be an int in [{lo}, {hi}] (got {value!r})")


def _check_step(name: str, value: object) -> None:
    _check_int(name, value, -1, MAX_STEP)


# --- control messages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Join:
    n_params: int
    world_size: int

    def __post_init__(self) -> None:
        _check_int("n_params", self.n_params, 1, 1 << 40)
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)


@dataclass(frozen=True)
class Welcome:
    n_params: int
    world_size: int
    start_step: int  # first step of this attempt's log (0 fresh, complete_through+1 on resume)
    complete_through: int
    # what the attempt inherits besides the parameters (tallies.AttemptNotes): rank 0's early-stopping
    # state and decision, the checkpoint a retried stage rolled back to; (name, value) pairs
    notes: tuple[tuple[str, float], ...] = ()
    aggregate: bool = False  # the log is the relay's one aggregated message per step

    def __post_init__(self) -> None:
        _check_int("n_params", self.n_params, 1, 1 << 40)
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _check_int("start_step", self.start_step, 0, MAX_STEP)
        _check_step("complete_through", self.complete_through)
        if (
            not isinstance(self.notes, tuple)
            or len(self.notes) > MAX_NOTES
            or not all(
                isinstance(n, tuple)
                and len(n) == 2
                and isinstance(n[0], str)
                and 0 < len(n[0]) <= 32
                and isinstance(n[1], float)
                for n in self.notes
            )
        ):
            raise ValueError(f"notes must be at most {MAX_NOTES} (name, float) pairs, names of 1..32 characters")
        if type(self.aggregate) is not bool:
            raise ValueError(f"aggregate must be a bool (got {self.aggregate!r})")


@dataclass(frozen=True)
class Reject:
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or len(self.reason) > 400:
            raise ValueError("reason must be a str of at most 400 characters")


@dataclass(frozen=True)
class Ack:
    steps: tuple[int, ...]  # steps of the receiver's own updates that the relay holds completely

    def __post_init__(self) -> None:
        if len(self.steps) > MAX_NAK_ITEMS:
            raise ValueError(f"at most {MAX_NAK_ITEMS} steps per ACK")
        for s in self.steps:
            _check_int("step", s, 0, MAX_STEP)


@dataclass(frozen=True)
class NakItem:
    step: int
    origin: int
    chunks: tuple[int, ...]  # missing chunk indices; empty = the whole message

    def __post_init__(self) -> None:
        _check_int("step", self.step, 0, MAX_STEP)
        _check_int("origin", self.origin, 0, AGGREGATE_ORIGIN)
        if len(self.chunks) > MAX_NAK_ITEMS:
            raise ValueError(f"at most {MAX_NAK_ITEMS} chunk indices per NAK item")
        for c in self.chunks:
            _check_int("chunk", c, 0, (1 << 32) - 1)


@dataclass(frozen=True)
class Nak:
    items: tuple[NakItem, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.items) <= MAX_NAK_ITEMS:
            raise ValueError(f"a NAK holds 1..{MAX_NAK_ITEMS} items")


@dataclass(frozen=True)
class Heartbeat:
    delivered_through: int  # the peer has delivered its log completely through this step
    sent_through: int  # last step the peer has sent
    # the step the training thread is computing now, -1 while it waits on the log or does anything
    # else: the relay times it against step_timeout (progress not presence)
    computing: int = -1

    def __post_init__(self) -> None:
        _check_step("delivered_through", self.delivered_through)
        _check_step("sent_through", self.sent_through)
        _check_step("computing", self.computing)


@dataclass(frozen=True)
class Loading:
    """A task of this attempt is alive and still materialising its partition: sent before
    JOIN, every heartbeat interval, so a slow partition is not mistaken for a dead task."""


@dataclass(frozen=True)
class Ended:
    rank: int
    last_step: int  # messages (t, rank) exist exactly for t <= last_step
    gone: bool  # declared gone by the relay (else: FINISHED)

    def __post_init__(self) -> None:
        _check_int("rank", self.rank, 0, MAX_WORLD_SIZE - 1)
        _check_step("last_step", self.last_step)


@dataclass(frozen=True)
class Status:
    """One page of the relay's view: ranks ``first_rank .. first_rank + len(have) - 1`` of ``world_size``
    (a job of more than STATUS_PAGE_RANKS ranks gets several pages, each its own datagram)."""

    start_step: int
    complete_through: int
    world_size: int
    first_rank: int
    have: tuple[int, ...]  # per page rank: the relay holds (t, rank) for every start_step <= t <= have[i]
    ended: tuple[Ended, ...]  # the page's ranks that ended

    def __post_init__(self) -> None:
        _check_int("start_step", self.start_step, 0, MAX_STEP)
        _check_step("complete_through", self.complete_through)
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _check_int("first_rank", self.first_rank, 0, self.world_size - 1)
        if not 1 <= len(self.have) <= min(STATUS_PAGE_RANKS, self.world_size - self.first_rank):
            raise ValueError(
                f"have must list 1..{STATUS_PAGE_RANKS} ranks from first_rank {self.first_rank} "
                f"within world_size {self.world_size} (got {len(self.have)})"
            )
        for h in self.have:
            _check_step("have", h)
        for e in self.ended:
            if not self.first_rank <= e.rank < self.first_rank + len(self.have):
                raise ValueError(
                    f"ended rank {e.rank} is outside this page (ranks {self.first_rank}.."
                    f"{self.first_rank + len(self.have) - 1})"
                )
        if len({e.rank for e in self.ended}) != len(self.ended):
            raise ValueError("an ended rank is listed twice")


@dataclass(frozen=True)
class Finished:
    last_step: int

    def __post_init__(self) -> None:
        _check_step("last_step", self.last_step)


@dataclass(frozen=True)
class Leave:
    pass


@dataclass(frozen=True)
class Fail:
    """A rank's training failed. ``fatal``: with an error a retry would repeat (the driver stops
    the job at once instead of waiting out Spark's stage retries); otherwise the report only tells the
    driver which class to raise if the job fails after all (reports.WorkerFailure, whose fields
    these are). Sent by a rank, joined or not; the relay answers FAIL_ACK. ``attempt`` is repeated in the
    body so the acknowledgement can name it back."""

    rank: int
    attempt: int
    error_type: str
    message: str
    step: int = -1  # the step the rank was in; -1: before its first
    fatal: bool = True
    error_class: str = "TrainingError"  # the class the driver raises (reports.error_class_name)
    cause: str = ""  # the first cause of the error's chain; "": no chain

    def __post_init__(self) -> None:
        _check_int("rank", self.rank, 0, MAX_WORLD_SIZE - 1)
        _check_int("attempt", self.attempt, 0, (1 << 16) - 1)
        _check_step("step", self.step)
        for name in ("error_type", "error_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 1 <= len(value) <= MAX_ERROR_TYPE:
                raise ValueError(f"{name} must be a str of 1..{MAX_ERROR_TYPE} characters")
        for name in ("message", "cause"):
            if not isinstance(getattr(self, name), str) or len(getattr(self, name)) > MAX_ERROR_TEXT:
                raise ValueError(f"{name} must be a str of at most {MAX_ERROR_TEXT} characters")
        if not isinstance(self.fatal, bool):
            raise ValueError("fatal must be a bool")


@dataclass(frozen=True)
class FailAck:
    rank: int
    attempt: int

    def __post_init__(self) -> None:
        _check_int("rank", self.rank, 0, MAX_WORLD_SIZE - 1)
        _check_int("attempt", self.attempt, 0, (1 << 16) - 1)


@dataclass(frozen=True)
class SnapRequest:
    pass


@dataclass(frozen=True)
class SnapInfo:
    snap_id: int
    step: int  # the parameters hold the log applied through this step
    n_params: int
    n_chunks: int
    chunk_bytes: int
    digest: str  # param_hash of the snapshot, checked after reassembly

    def __post_init__(self) -> None:
        _check_int("snap_id", self.snap_id, 0, (1 << 32) - 1)
        _check_step("step", self.step)
        _check_int("n_params", self.n_params, 1, 1 << 40)
        _check_int("n_chunks", self.n_chunks, 1, (1 << 32) - 1)
        _check_int("chunk_bytes", self.chunk_bytes, 4, 1 << 16)
        if self.chunk_bytes % 4:
            raise ValueError("chunk_bytes must be a multiple of 4 (whole float32 values)")
        if not isinstance(self.digest, str) or len(self.digest) > 128:
            raise ValueError("digest must be a str of at most 128 characters")


@dataclass(frozen=True)
class SnapNak:
    snap_id: int
    ranges: tuple[tuple[int, int], ...]  # missing chunk ranges [start, stop)

    def __post_init__(self) -> None:
        _check_int("snap_id", self.snap_id, 0, (1 << 32) - 1)
        if not 1 <= len(self.ranges) <= MAX_NAK_ITEMS:
            raise ValueError(f"a SNAP_NAK holds 1..{MAX_NAK_ITEMS} ranges")
        for a, b in self.ranges:
            _check_int("range start", a, 0, (1 << 32) - 1)
            _check_int("range stop", b, a + 1, 1 << 32)


@dataclass(frozen=True)
class SnapDone:
    snap_id: int

    def __post_init__(self) -> None:
        _check_int("snap_id", self.snap_id, 0, (1 << 32) - 1)


# --- events out of the cores --------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """One message of the apply log, delivered in canonical (step, sender) order.

    ``arrived``: the core's clock when its last chunk came in (for our own update, when it was sent);
    not part of equality: the same log entry compares equal at every peer."""

    step: int
    sender: int
    payload: bytes
    meta: StepMeta | None = None
    arrived: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        _check_int("step", self.step, 0, MAX_STEP)
        _check_int("sender", self.sender, 0, AGGREGATE_ORIGIN)
        if not isinstance(self.payload, bytes):
            raise TypeError("payload must be bytes")
        if self.meta is not None and not isinstance(self.meta, StepMeta):
            raise TypeError("meta must be a StepMeta or None")


@dataclass(frozen=True)
class PeerJoined:
    rank: int
    attempt: int
    address: Address


@dataclass(frozen=True)
class PeerEnded:
    rank: int
    last_step: int
    gone: bool
    reason: str


@dataclass(frozen=True)
class PeerFailed:
    """Relay: a rank reported a failure (FAIL): its fields."""

    rank: int
    attempt: int
    error_type: str
    message: str
    step: int = -1
    fatal: bool = True
    error_class: str = "TrainingError"
    cause: str = ""


INCIDENT_KINDS = ("suspected", "back", "silent", "stuck", "gone", "restart")
FATAL_INCIDENTS = ("silent", "stuck")  # the relay gives up: the driver stops the job with this cause


@dataclass(frozen=True)
class Incident:
    """Relay: why and when it suspected, cut or gave up on a rank (the driver reports the
    first cause, not the last symptom). ``step`` is the step the rank owes the log (or is stuck in);
    ``seconds`` how long it had been silent or stuck; ``at`` the relay's clock."""

    kind: str
    rank: int
    attempt: int
    step: int
    seconds: float
    at: float
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in INCIDENT_KINDS:
            raise ValueError(f"kind must be one of {INCIDENT_KINDS} (got {self.kind!r})")
        _check_int("rank", self.rank, 0, MAX_WORLD_SIZE - 1)
        _check_step("step", self.step)
        if not self.seconds >= 0:
            raise ValueError(f"seconds must be >= 0 (got {self.seconds!r})")

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL_INCIDENTS

    def describe(self) -> str:
        what = {
            "suspected": f"silent for {self.seconds:.1f} s (suspected)",
            "back": f"came back after {self.seconds:.1f} s of silence",
            "silent": f"silent for {self.seconds:.1f} s: the relay gave up waiting for it",
            "stuck": f"stuck in step {self.step}: no step finished for {self.seconds:.1f} s (step_timeout)",
            "gone": f"declared gone after {self.seconds:.1f} s",
            "restart": f"silent for {self.seconds:.1f} s: the relay restarts the stage",
        }[self.kind]
        tail = f" ({self.detail})" if self.detail else ""
        return f"rank {self.rank} (attempt {self.attempt}, at step {self.step}) {what}{tail}"


def first_cause(incidents: list[Incident]) -> Incident | None:
    """The earliest incident that still explains a failure: a suspicion the rank recovered from
    (a later "back" of the same rank and attempt) does not."""
    cleared = {(inc.rank, inc.attempt) for inc in incidents if inc.kind == "back"}
    for inc in incidents:
        if inc.kind == "back" or (inc.kind == "suspected" and (inc.rank, inc.attempt) in cleared):
            continue
        return inc
    return None


def first_fatal(incidents: list[Incident]) -> Incident | None:
    """The first incident after which the relay gave up on a rank."""
    return next((i for i in incidents if i.fatal), None)


@dataclass(frozen=True)
class AttemptStarted:
    attempt: int
    start_step: int


@dataclass(frozen=True)
class Welcomed:
    info: Welcome


@dataclass(frozen=True)
class Rejected:
    """Peer: the relay refused this peer (REJECT, a WELCOME for another job, declared gone); ``reason``
    is what every later call raises."""

    reason: str


@dataclass(frozen=True)
class SnapshotReady:
    step: int
    params: NDArray[np.float32]


@dataclass(frozen=True)
class SnapshotFailed:
    """Peer: a downloaded snapshot failed its hash check; ``reason`` is what every later call raises."""

    reason: str


@dataclass(frozen=True)
class RolledBack:
    """Relay: a retried stage restarted its log at a checkpoint (``rollback``), not at complete_through."""

    attempt: int
    from_step: int  # complete_through when the attempt started
    to_step: int  # the checkpoint's step: the log restarts after it


@dataclass(frozen=True)
class LogComplete:
    """Relay: every rank ended and the whole log is applied."""

    complete_through: int


# What wire.decode_control can return: one class per control kind (wire.Kind), UPDATE/SNAP_CHUNK excepted
ControlMessage = (
    Join
    | Welcome
    | Reject
    | Ack
    | Nak
    | Heartbeat
    | Status
    | Finished
    | Leave
    | SnapRequest
    | SnapInfo
    | SnapNak
    | SnapDone
    | Fail
    | FailAck
    | Loading
)
# What PeerCore.next_event and RelayCore.next_event return
PeerEvent = Welcomed | Rejected | SnapshotReady | SnapshotFailed | PeerEnded | FailAck
RelayEvent = PeerJoined | PeerEnded | PeerFailed | Incident | AttemptStarted | RolledBack | LogComplete
