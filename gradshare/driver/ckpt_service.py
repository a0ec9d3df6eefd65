"""The driver's checkpoint service: workers' checkpoint files to and from a Hadoop-FS checkpoint_dir.

Executors have no JVM gateway, so a worker cannot open an hdfs:// (s3a://, ...) path itself. With a
checkpoint_dir or resume_from that is not local, the driver runs this small TCP service on its bind
address; each worker streams its state to it (residual, optimizer state, rule state: several times the
parameters), and the driver writes it through the Hadoop FileSystem API (stores.HadoopStore), with the
same digests, file lists and manifest-written-last rules as the local path (task/checkpoint.py). Reads (a
resumed fit, a retried stage's rollback) come back the same way.

The workers' side (`ServiceStore`) and the sealed framing both sides speak (the wire): task/ckpt_client.py.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from gradshare.errors import RemoteProtocolError
from gradshare.task.ckpt_client import Sealed, check_name
from gradshare.task.stores import error_line

MAX_CONNECTIONS = 64  # concurrent operations the driver serves; more wait in the listen backlog
OPS = ("write", "read", "list", "exists", "is_dir")


class CheckpointService:
    """``CheckpointService({"checkpoint": store, "resume": store}, key, bind, timeout).start()``; the
    workers' ServiceStore reaches it at `address`. A context manager."""

    def __init__(self, stores: dict[str, Any], key: bytes, bind: str = "0.0.0.0", timeout: float = 60.0):
        self.stores, self.key, self.bind, self.timeout = dict(stores), key, bind, float(timeout)
        self.address: tuple[str, int] | None = None
        self.errors: list[str] = []  # what went wrong serving (bounded): a failed fit's driver shows it
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread: threading.Thread | None = None

    def start(self) -> CheckpointService:
        self._sock = socket.create_server((self.bind, 0))
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept, name=f"gradshare-ckpt-{self.address[1]}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> CheckpointService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        sock = self._sock
        assert sock is not None  # start() made it before starting this thread
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(timeout=self.timeout):
                conn.close()  # the worker's wait times out and names the file
                continue
            threading.Thread(target=self._serve, args=(conn,), name="gradshare-ckpt-op", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.timeout)
            salt = os.urandom(7)
            conn.sendall(salt)
            link = Sealed(conn, self.key, salt, b"S")
            request = link.receive_json()
            try:
                answer = self._do(link, request)
            except Exception as e:  # noqa: BLE001 - the store's error (Py4J's wraps Java's IOException) goes back
                answer = {"ok": False, "error": f"{type(e).__name__}: {error_line(e)}"}
                self._note(f"{request.get('op')} {request.get('name')}: {answer['error']}")
            link.send_json(answer)
        except Exception as e:  # noqa: BLE001 - a bad or broken connection never takes the driver down
            self._note(f"connection: {type(e).__name__}: {e}")
        finally:
            conn.close()
            self._slots.release()

    def _note(self, text: str) -> None:
        if len(self.errors) < 100:
            self.errors.append(text)

    def _do(self, link: Sealed, request: dict[str, Any]) -> dict[str, Any]:
        op, name = request.get("op"), check_name(request.get("name", ""))
        named = request.get("store")
        store = self.stores.get(named) if isinstance(named, str) else None
        if op not in OPS or store is None:
            raise RemoteProtocolError(f"unknown checkpoint request {op!r} for store {request.get('store')!r}")
        if op == "write":
            return {"ok": True, "digest": store.write(name, link.receive_stream(), atomic=bool(request.get("atomic")))}
        if op == "read":
            if not store.exists(name):
                return {"ok": False, "missing": True, "error": f"{store.where(name)} does not exist"}
            link.send_json({"ok": True})
            link.send_stream(store.read(name))
            return {"ok": True}
        if op == "list":
            return {"ok": True, "names": store.list(name)}
        return {"ok": True, "value": bool(getattr(store, op)(name))}
