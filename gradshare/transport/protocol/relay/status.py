"""The relay's STATUS pages, sans I/O: which ranks a page holds, whose heartbeat gets which page, and the
pages as last built.

A page's worst case is ~16 bytes per rank + 32 of framing (events.STATUS_PAGE_RANKS), so a page holds as
many ranks as fit one datagram. Every peer's heartbeat (20/s each) is answered with one page, so at N = 32
a page is asked for ~640 times a second and changes far less often: a page is rebuilt only when its key
moves: the attempt (a new cursor and rank table), complete_through, or the page's change count, bumped
where one of its ranks gets an update or ends.
"""

from __future__ import annotations

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.relay.attempt import Attempt


class StatusPages:
    def __init__(self, world_size: int, chunk_bytes: int) -> None:
        self.world_size = world_size
        self.ranks_per_page = max(1, min(ev.STATUS_PAGE_RANKS, (chunk_bytes - 32) // 16))
        self.n_pages = -(-world_size // self.ranks_per_page)
        self._turn = [0] * world_size  # per rank: which page its next heartbeat gets
        self._built: dict[int, tuple[tuple[int, int, int], ev.Status]] = {}
        self._changes = [0] * self.n_pages

    def page_of(self, rank: int) -> int:
        return rank // self.ranks_per_page

    def changed(self, rank: int) -> None:
        """Rank ``rank``'s entry moved (an update came in, or it ended): its page is built anew."""
        self._changes[rank // self.ranks_per_page] += 1

    def next_turn(self, rank: int) -> int:
        """The page rank ``rank``'s heartbeat is answered with: the pages in turn, so a heartbeat's answer
        stays one datagram at any world size and each peer still sees every rank every n_pages heartbeats."""
        turn = self._turn[rank]
        self._turn[rank] = turn + 1
        return turn % self.n_pages

    def page(self, page: int, att: Attempt) -> ev.Status:
        """STATUS page ``page`` of attempt ``att``: ranks page·ranks_per_page onwards."""
        cursor = att.cursor
        key = (att.number, cursor.complete_through, self._changes[page])
        built = self._built.get(page)
        if built is not None and built[0] == key:
            return built[1]
        start = cursor.start_step
        rows = att.ranks[page * self.ranks_per_page : (page + 1) * self.ranks_per_page]
        status = ev.Status(
            start,
            cursor.complete_through,
            self.world_size,
            rows[0].rank,
            tuple(r.received.contiguous_from(start) - 1 for r in rows),
            tuple(r.ended for r in rows if r.ended is not None),
        )
        self._built[page] = (key, status)
        return status


__all__ = ["StatusPages"]
