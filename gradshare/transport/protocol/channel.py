"""Sealing and opening datagrams for one endpoint: header, AEAD, replay window, drop counting.

Shared by the relay and the peer cores; pure (no sockets, no clock). Every refused datagram is counted
under a reason in ``drops`` (docs/design.md: "dropped and counted, never applied, never a crash").
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Literal, overload

from gradshare.errors import DecodeError
from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol import wire
from gradshare.transport.protocol.crypto import MAX_COUNTER, ReplayGuard, Sealer
from gradshare.transport.protocol.wire import HEADER_BYTES, Header


class Channel:
    def __init__(
        self,
        *,
        key: bytes | None,
        insecure: bool,
        job: int,
        sender: int,
        attempt: int,
        datagram_size: int,
        max_chunks: int,
        max_windows: int,
        session: int | None = None,
    ) -> None:
        self.sealer = Sealer(key, insecure)
        self.job = job
        self.sender = sender
        self.attempt = attempt
        self.session = int.from_bytes(os.urandom(4), "little") if session is None else session
        self.counter = 0
        self.datagram_size = wire.check_datagram_size(datagram_size)
        self.chunk_bytes = datagram_size - HEADER_BYTES - self.sealer.tag_bytes
        self.max_chunks = max_chunks
        self.replay = ReplayGuard(max_windows)
        self.drops: Counter[str] = Counter()

    # --- out --------------------------------------------------------------------------------------
    def seal(self, kind: int, body: bytes, origin: int = 0, step: int = 0, index: int = 0, count: int = 1) -> bytes:
        c = self.counter
        if c >= MAX_COUNTER:
            raise OverflowError("nonce counter exhausted; start a new session")
        self.counter = c + 1
        # the struct directly (not via a Header tuple): this runs once per datagram sent
        header = wire.HEADER.pack(
            wire.MAGIC,
            wire.VERSION,
            kind,
            self.sender,
            self.attempt,
            self.job,
            self.session,
            c,
            origin,
            step,
            index,
            count,
        )
        return self.sealer.seal(header, self.sender, self.session, c, body)

    def seal_control(self, msg: ev.ControlMessage) -> bytes:
        kind, body = wire.encode_control(msg)
        return self.seal(kind, body)

    def seal_chunks(
        self,
        kind: int,
        body: bytes,
        origin: int,
        step: int,
        only: tuple[int, ...] | None = None,
        chunk_bytes: int | None = None,
    ) -> list[bytes]:
        """``body`` as sealed chunks of ``chunk_bytes`` (default: what fits ``datagram_size``)."""
        chunks = wire.split(body, chunk_bytes or self.chunk_bytes)
        n = len(chunks)
        idx = range(n) if not only else [i for i in only if i < n]
        return [self.seal(kind, chunks[i], origin, step, i, n) for i in idx]

    # --- in ---------------------------------------------------------------------------------------
    def parse(self, data: bytes, max_size: int | None = None) -> Header | None:
        """The header if the datagram is plausibly ours (before authentication), else None (counted)."""
        if len(data) > (max_size or self.datagram_size):
            self.drops["oversized"] += 1
            return None
        try:
            h = wire.decode_header(data, self.max_chunks)
        except DecodeError:
            self.drops["malformed"] += 1
            return None
        if h.job != self.job:
            self.drops["wrong_job"] += 1
            return None
        return h

    def open(self, h: Header, data: bytes, replay_window: bool = True) -> bytes | None:
        """The authenticated body, or None (counted: auth_failed / replayed / too_old).

        ``replay_window=False`` is for update chunks the relay forwards unchanged: a retransmission is then
        the origin's original datagram, older than any window, and exactly-once comes from the receiver's
        (attempt, step, origin, chunk) bookkeeping instead (a replayed chunk is a duplicate there)."""
        return self.open_fields(h.sender, h.attempt, h.session, h.counter, data, replay_window)

    def open_fields(
        self, sender: int, attempt: int, session: int, counter: int, data: bytes, replay_window: bool = True
    ) -> bytes | None:
        """`open` from the header's fields (the relay's fast path has them without a Header)."""
        who = (sender, attempt, session)
        if replay_window:
            reason = self.replay.check(who, counter)
            if reason is not None:
                self.drops[reason] += 1
                return None
        body = self.sealer.open(data[:HEADER_BYTES], sender, session, counter, data[HEADER_BYTES:])
        if body is None:
            self.drops["auth_failed"] += 1
            return None
        if replay_window:
            self.replay.accept(who, counter)
        return body

    # The cores ask for these kinds by name (wire.Kind.JOIN, .FAIL, .FAIL_ACK, .LOADING; a Literal cannot name a class
    # attribute, hence the numbers): the answer is then that kind's class. Any other kind: the union.
    @overload
    def control(self, kind: Literal[1], body: bytes) -> ev.Join | None: ...
    @overload
    def control(self, kind: Literal[16], body: bytes) -> ev.Fail | None: ...
    @overload
    def control(self, kind: Literal[17], body: bytes) -> ev.FailAck | None: ...
    @overload
    def control(self, kind: Literal[18], body: bytes) -> ev.Loading | None: ...
    @overload
    def control(self, kind: int, body: bytes) -> ev.ControlMessage | None: ...

    def control(self, kind: int, body: bytes) -> ev.ControlMessage | None:
        """The control message in an authenticated body, or None (counted as bad_body)."""
        try:
            return wire.decode_control(kind, body)
        except DecodeError:
            self.drops["bad_body"] += 1
            return None
