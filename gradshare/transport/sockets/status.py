"""The status channel's two ends (protocol/status_wire.py): `StatusSender` beside an in-job relay pushes the
relay's status to the client; `StatusInbox` on the client receives it and answers the same reads a `Relay`
answers the driver (progress, failure, reported_failure, first_cause, fatal_incident), so the driver's
stage loop follows either. A status that does not arrive is not an error: the inbox then answers as a
relay that has heard nothing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from gradshare.transport.protocol import events as ev
from gradshare.transport.protocol.status_wire import MAX_STATUS_BYTES, Status, StatusOpener, StatusSealer
from gradshare.transport.sockets import udp

PUSH_INTERVAL = 0.5  # s between statuses: the bar moves twice a second; a fatal one goes out at once


class StatusSender:
    """A thread that sends ``read()`` to `inbox` every `interval` s until closed (and once more then)."""

    def __init__(
        self,
        read: Callable[[], Status],
        inbox: tuple[str, int],
        key: bytes | None,
        job_id: int,
        insecure: bool = False,
        interval: float = PUSH_INTERVAL,
    ) -> None:
        self.read, self.inbox, self.interval = read, inbox, interval
        self.sealer = StatusSealer(key, job_id, insecure)
        family = socket.getaddrinfo(inbox[0], inbox[1], type=socket.SOCK_DGRAM)[0][0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sent = self.failed = 0
        self.error = ""  # the first status that could not be read or sealed (send)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradshare-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.send()

    def send(self) -> None:
        """One status now; a send the network refuses is counted, not raised (the client may be gone).
        A status that cannot be read or sealed is counted too, its first error kept in `error`: the
        pushes are the client's view only, and must not stop the thread or the relay's task."""
        try:
            data = self.sealer.seal(self.read())
        except Exception as e:  # noqa: BLE001 - kept, counted; the training goes on without the push
            self.failed += 1
            self.error = self.error or f"{type(e).__name__}: {e}"
            return
        try:
            self.sock.sendto(data, self.inbox)
            self.sent += 1
        except OSError:
            self.failed += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.send()  # the final state: the log's last step, a failure that came at the end
        self.sock.close()


class StatusReads:
    """The reads the driver's stage loop makes of a `Relay`, answered from `status()`: as a relay that has
    heard nothing while there is none (this class itself never has one)."""

    def status(self) -> Status | None:
        return None

    def _read(self) -> Status:
        return self.status() or NOTHING_HEARD

    def progress(self) -> dict[str, object]:
        return dict(self._read().progress)

    def failure(self) -> ev.Fail | None:
        return self._read().failure

    def reported_failure(self) -> ev.Fail | None:
        return self._read().reported

    def first_cause(self) -> ev.Incident | None:
        return self._read().first_cause

    def fatal_incident(self) -> ev.Incident | None:
        return self._read().fatal


NOTHING_HEARD = Status(progress={})


class StatusInbox(StatusReads):
    """The client's end: a UDP socket bound to (bind, port) and a thread that keeps the newest status."""

    def __init__(
        self, key: bytes | None, job_id: int, bind: str = "0.0.0.0", port: int = 0, insecure: bool = False
    ) -> None:
        self.opener = StatusOpener(key, job_id, insecure)
        self.sock = udp.open_udp(bind, port, "status inbox")
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.received = 0
        self._status: Status | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradshare-status-inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not udp.wait_readable(self.sock, 0.2):
                continue
            while True:
                try:
                    data = self.sock.recv(MAX_STATUS_BYTES + 1024)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return  # closed
                status = self.opener.open(data)
                if status is not None:
                    with self._lock:
                        self._status = status
                        self.received += 1

    def status(self) -> Status | None:
        with self._lock:
            return self._status

    @property
    def dropped(self) -> int:
        return self.opener.dropped

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.sock.close()
