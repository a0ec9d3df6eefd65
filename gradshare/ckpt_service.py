"""The driver's checkpoint service: workers' checkpoint files to and from a Hadoop-FS checkpoint_dir.

Executors have no JVM gateway, so a worker cannot open an hdfs:// (s3a://, ...) path itself. With a
checkpoint_dir or resume_from that is not local, the driver runs this small TCP service on its bind
address; each worker streams its state to it (residual, optimizer state, rule state: several times the
parameters), and the driver writes it through the Hadoop FileSystem API (stores.HadoopStore), with the
same digests, file lists and manifest-written-last rules as the local path (checkpoint.py). Reads (a
resumed fit, a retried stage's rollback) come back the same way.

Wire: one TCP connection per operation. The server first sends 16 random bytes; every frame after
that is ``u32 length | AES-256-GCM(body)`` under the job key (the relay's, transport/protocol/crypto.py), with
nonce = direction byte + 7 of the server's random bytes + a 4-byte frame counter, so a recorded
connection does not replay. The first client frame is a JSON request; file data travels in frames of
at most stores.CHUNK bytes ("D" + data), "E" ends it; the answer is a JSON frame. No pickle.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gradshare.errors import CheckpointError, RemoteProtocolError, TransportTimeout
from gradshare.stores import CHUNK, error_line

MAX_FRAME = CHUNK + 4096  # a data chunk, its mark and tag; a request or answer is far smaller
MAX_CONNECTIONS = 64      # concurrent operations the driver serves; more wait in the listen backlog
OPS = ("write", "read", "list", "exists", "is_dir")
_LEN = struct.Struct("<I")


class _Sealed:
    """Frames of one connection, sealed under the job key (module docstring)."""

    def __init__(self, sock: socket.socket, key: bytes, salt: bytes, sending: bytes):
        self.sock, self.aead, self.salt = sock, AESGCM(key), salt
        self.out_dir, self.in_dir = sending, b"S" if sending == b"C" else b"C"
        self.sent = self.received = 0

    def send(self, body: bytes) -> None:
        sealed = self.aead.encrypt(self.out_dir + self.salt + _LEN.pack(self.sent), body, None)
        self.sent += 1
        self.sock.sendall(_LEN.pack(len(sealed)) + sealed)

    def receive(self) -> bytes:
        (n,) = _LEN.unpack(_exactly(self.sock, _LEN.size))
        if n > MAX_FRAME:
            raise RemoteProtocolError(f"checkpoint frame of {n} bytes > {MAX_FRAME}")
        sealed = _exactly(self.sock, n)
        try:
            body = self.aead.decrypt(self.in_dir + self.salt + _LEN.pack(self.received), sealed, None)
        except InvalidTag:
            raise RemoteProtocolError("checkpoint frame failed authentication (another job's key?)") from None
        self.received += 1
        return body

    def send_json(self, obj: dict) -> None:
        self.send(json.dumps(obj).encode())

    def receive_json(self) -> dict:
        try:
            obj = json.loads(self.receive())
        except ValueError as e:
            raise RemoteProtocolError(f"checkpoint message is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise RemoteProtocolError("checkpoint message is not a JSON object")
        return obj

    def send_stream(self, chunks: Iterable[bytes]) -> None:
        """Data frames ("D" + at most CHUNK bytes), then "E". A sender that fails midway sends its JSON
        answer instead, which ends the stream as an error (`receive_stream`)."""
        for chunk in chunks:
            for i in range(0, len(chunk), CHUNK):
                self.send(b"D" + chunk[i:i + CHUNK])
        self.send(b"E")

    def receive_stream(self) -> Iterator[bytes]:
        while True:
            frame = self.receive()
            if frame[:1] == b"D":
                yield frame[1:]
            elif frame == b"E":
                return
            else:
                try:
                    error = json.loads(frame).get("error")
                except (ValueError, AttributeError):
                    error = "a frame that is neither data nor an answer"
                raise StreamAborted(str(error))


class StreamAborted(RemoteProtocolError):
    """The other side stopped a file's stream with an error (e.g. the driver's read failed midway)."""


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            raise ConnectionError("the checkpoint connection closed mid-frame")
        buf += part
    return bytes(buf)


def check_name(name: object) -> str:
    """A relative '/'-separated name inside the store: no absolute path, no '..'."""
    if not isinstance(name, str) or len(name) > 400 or name.startswith("/") or "\\" in name or any(
            part in ("..", ".") for part in name.split("/")):
        raise RemoteProtocolError(f"bad checkpoint file name {name!r}")
    return name


class CheckpointService:
    """``CheckpointService({"checkpoint": store, "resume": store}, key, bind, timeout).start()``; the
    workers' ServiceStore reaches it at `address`. A context manager."""

    def __init__(self, stores: dict, key: bytes, bind: str = "0.0.0.0", timeout: float = 60.0):
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

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
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
            link = _Sealed(conn, self.key, salt, b"S")
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

    def _do(self, link: _Sealed, request: dict) -> dict:
        op, name = request.get("op"), check_name(request.get("name", ""))
        store = self.stores.get(request.get("store"))
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


class ServiceStore:
    """A worker's view of one of the driver's stores (stores.py's interface, minus remove)."""

    def __init__(self, address, key: bytes, store: str, rank: int, timeout: float, root: str):
        self.address, self.key, self.store, self.rank = tuple(address), key, store, rank
        self.timeout, self.root = float(timeout), root

    def where(self, name: str = "") -> str:
        return "/".join([self.root.rstrip("/"), *[p for p in name.split("/") if p]])

    @contextmanager
    def _named(self, what: str):
        """Failures of one operation as errors naming the rank, the file and the driver (`what`)."""
        try:
            yield
        except StreamAborted as e:
            raise CheckpointError(f"{what}: {e}") from e
        except (TimeoutError, socket.timeout) as e:
            raise TransportTimeout(f"{what}: no answer within {self.timeout:g} s") from e
        except ConnectionError as e:
            raise CheckpointError(f"{what}: the driver hung up without an answer ({e}; another job's key?)") from e

    def _connect(self, op: str, name: str, **extra):
        what = f"rank {self.rank}'s checkpoint {op} of {self.where(name)} through the driver {self.address}"
        with self._named(what):  # the request too: a driver gone mid-handshake is named like any failure
            sock = socket.create_connection(self.address, timeout=self.timeout)
            try:
                link = _Sealed(sock, self.key, _exactly(sock, 7), b"C")
                link.send_json({"op": op, "store": self.store, "name": name, "rank": self.rank, **extra})
            except BaseException:
                sock.close()
                raise
        return sock, link, what

    def _call(self, op: str, name: str, body=None, **extra) -> dict:
        sock, link, what = self._connect(op, name, **extra)
        try:
            with self._named(what):
                if body is not None:
                    link.send_stream(body)
                answer = link.receive_json()
        finally:
            sock.close()
        if not answer.get("ok"):
            raise CheckpointError(f"{what}: {answer.get('error')}")
        return answer

    def write(self, name: str, chunks: Iterable[bytes], atomic: bool = False) -> dict:
        return self._call("write", name, body=chunks, atomic=atomic)["digest"]

    def read(self, name: str) -> Iterator[bytes]:
        sock, link, what = self._connect("read", name)
        try:
            with self._named(what):
                first = link.receive_json()
                if not first.get("ok"):
                    if first.get("missing"):
                        raise FileNotFoundError(f"{what}: {first.get('error')}")
                    raise CheckpointError(f"{what}: {first.get('error')}")
                yield from link.receive_stream()
                end = link.receive_json()
                if not end.get("ok"):
                    raise CheckpointError(f"{what}: {end.get('error')}")
        finally:
            sock.close()

    def list(self, name: str = "") -> list[str]:
        return list(self._call("list", name)["names"])

    def exists(self, name: str) -> bool:
        return bool(self._call("exists", name)["value"])

    def is_dir(self, name: str = "") -> bool:
        return bool(self._call("is_dir", name)["value"])

    def makedirs(self, name: str = "") -> None:
        """Nothing to do: the driver's store makes a file's parents as it writes it."""
