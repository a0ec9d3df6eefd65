"""The cores' tunables, one frozen object each, checked when made: ``RelayTuning`` for ``RelayCore``,
``PeerTuning`` for ``PeerCore``. Validated when built; a bad value raises ValueError naming the field.

What is not here is not a tunable: the job (world size, key, job id, datagram size, insecure), the
plug-ins (the update codec, the rollback, the aggregator) and how a shell drives a core (defer_apply).
"""

from __future__ import annotations

from dataclasses import dataclass

ON_RANK_LOSS = ("wait", "continue", "restart")
FORWARDING = ("per-rank", "aggregate")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (got {value!r})")


def _not_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0 (got {value!r})")


@dataclass(frozen=True)
class RelayTuning:
    """The relay core's tunables (their use: relay/core.py and the modules it names)."""

    liveness_timeout: float = 30.0  # s of silence after which a rank is suspected
    history_entries: int = 1 << 16  # the forwarded updates kept for NAK repair (history.py)
    history_bytes: int = 1 << 29
    reassembly_messages: int = 4096  # inbound updates in reassembly at once (reassembly.py)
    reassembly_bytes: int = 1 << 28
    max_ahead: int = 4096  # steps a rank may run ahead of its own contiguous prefix
    nak_delay: float = 0.004  # s a chunk may be late before it is NAKed (the reorder allowance)
    tick: float = 0.002  # s between timer runs while a NAK or pacing may be due
    snapshot_rate: float = 50e6  # bytes/s of snapshot chunks (relay/snapshots.py)
    snapshot_burst: int = 1 << 20  # bytes of snapshot one tick may send, however late it is
    snapshot_datagram_size: int | None = None  # None: the datagram size of updates
    max_snapshots: int = 2  # snapshot copies held at once
    on_rank_loss: str = "wait"  # ON_RANK_LOSS: what a suspected rank leads to (relay/liveness.py)
    give_up_after: float = 60.0  # "wait": s of silence before a fatal incident
    join_window: float | None = None  # s a rank not heard in an attempt has from its start (None: liveness_timeout)
    step_timeout: float | None = None  # s in the same computing step before a fatal "stuck" incident
    forwarding: str = "per-rank"  # FORWARDING: each rank's message, or the relay's one aggregate

    def __post_init__(self) -> None:
        if not self.liveness_timeout > 0:
            raise ValueError(f"liveness_timeout must be > 0 (got {self.liveness_timeout})")
        if self.on_rank_loss not in ON_RANK_LOSS:
            raise ValueError(f"on_rank_loss must be one of {ON_RANK_LOSS} (got {self.on_rank_loss!r})")
        if self.forwarding not in FORWARDING:
            raise ValueError(f"forwarding must be one of {FORWARDING} (got {self.forwarding!r})")
        for name in ("give_up_after", "join_window", "step_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (got {value!r})")
        _positive(
            self,
            "history_entries",
            "history_bytes",
            "reassembly_messages",
            "reassembly_bytes",
            "max_ahead",
            "tick",
            "snapshot_rate",
            "snapshot_burst",
            "snapshot_datagram_size",
            "max_snapshots",
        )
        _not_negative(self, "nak_delay")

    @property
    def join_seconds(self) -> float:
        """The join window in force: ``join_window``, or ``liveness_timeout`` when it is None."""
        return float(self.join_window if self.join_window is not None else self.liveness_timeout)


@dataclass(frozen=True)
class PeerTuning:
    """A peer core's tunables (their use: peer/core.py)."""

    heartbeat_interval: float = 0.05  # s between heartbeats (and LOADING, and FAIL resends)
    rto: float = 0.2  # the retransmit timeout's floor (peer/outstanding.py: RFC 6298 above it)
    nak_delay: float = 0.004  # s a forwarded chunk may be late before it is NAKed
    nak_interval: float = 0.05  # s between NAKs of one key before the first RTT sample
    tick: float = 0.002  # s between timer runs while a NAK may be due
    max_unacked: int = 4096  # own updates not yet acknowledged (send_update refuses more)
    max_unacked_bytes: int = 1 << 28
    inbox_messages: int = 1 << 16  # received updates held before delivery
    inbox_bytes: int = 1 << 30
    max_ahead: int = 4096  # steps ahead of the log's next one a chunk may be

    def __post_init__(self) -> None:
        _positive(
            self,
            "heartbeat_interval",
            "rto",
            "nak_interval",
            "tick",
            "max_unacked",
            "max_unacked_bytes",
            "inbox_messages",
            "inbox_bytes",
            "max_ahead",
        )
        _not_negative(self, "nak_delay")


__all__ = ["FORWARDING", "ON_RANK_LOSS", "PeerTuning", "RelayTuning"]
