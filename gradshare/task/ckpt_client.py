"""A worker's side of the driver's checkpoint service (driver/ckpt_service.py), and the sealed framing
both sides speak.

Executors have no JVM gateway, so a worker cannot open an hdfs:// (s3a://, ...) checkpoint_dir itself:
`ServiceStore` streams its files to the driver, which writes them through the Hadoop FileSystem API.

Wire: one TCP connection per operation. The server first sends 16 random bytes; every frame after
that is ``u32 length | AES-256-GCM(body)`` under the job key (the relay's, transport/protocol/crypto.py), with
nonce = direction byte + 7 of the server's random bytes + a 4-byte frame counter, so a recorded
connection does not replay. The first client frame is a JSON request; file data travels in frames of
at most stores.CHUNK bytes ("D" + data), "E" ends it; the answer is a JSON frame. No pickle.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gradshare.errors import CheckpointError, RemoteProtocolError, TransportTimeout
from gradshare.task.stores import CHUNK

MAX_FRAME = CHUNK + 4096  # a data chunk, its mark and tag; a request or answer is far smaller
_LEN = struct.Struct("<I")


class Sealed:
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

    def send_json(self, obj: dict[str, Any]) -> None:
        self.send(json.dumps(obj).encode())

    def receive_json(self) -> dict[str, Any]:
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
                self.send(b"D" + chunk[i : i + CHUNK])
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
    if (
        not isinstance(name, str)
        or len(name) > 400
        or name.startswith("/")
        or "\\" in name
        or any(part in ("..", ".") for part in name.split("/"))
    ):
        raise RemoteProtocolError(f"bad checkpoint file name {name!r}")
    return name


class ServiceStore:
    """A worker's view of one of the driver's stores (stores.py's interface, minus remove)."""

    def __init__(self, address: Iterable[Any], key: bytes, store: str, rank: int, timeout: float, root: str):
        self.address, self.key, self.store, self.rank = tuple(address), key, store, rank
        self.timeout, self.root = float(timeout), root

    def where(self, name: str = "") -> str:
        return "/".join([self.root.rstrip("/"), *[p for p in name.split("/") if p]])

    @contextmanager
    def _named(self, what: str) -> Iterator[None]:
        """Failures of one operation as errors naming the rank, the file and the driver (`what`)."""
        try:
            yield
        except StreamAborted as e:
            raise CheckpointError(f"{what}: {e}") from e
        except TimeoutError as e:
            raise TransportTimeout(f"{what}: no answer within {self.timeout:g} s") from e
        except ConnectionError as e:
            raise CheckpointError(f"{what}: the driver hung up without an answer ({e}; another job's key?)") from e

    def _connect(self, op: str, name: str, **extra: object) -> tuple[socket.socket, Sealed, str]:
        what = f"rank {self.rank}'s checkpoint {op} of {self.where(name)} through the driver {self.address}"
        with self._named(what):  # the request too: a driver gone mid-handshake is named like any failure
            sock = socket.create_connection(self.address, timeout=self.timeout)
            try:
                link = Sealed(sock, self.key, _exactly(sock, 7), b"C")
                link.send_json({"op": op, "store": self.store, "name": name, "rank": self.rank, **extra})
            except BaseException:
                sock.close()
                raise
        return sock, link, what

    def _call(self, op: str, name: str, body: Iterable[bytes] | None = None, **extra: object) -> dict[str, Any]:
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

    def write(self, name: str, chunks: Iterable[bytes], atomic: bool = False) -> dict[str, Any]:
        digest: dict[str, Any] = self._call("write", name, body=chunks, atomic=atomic)["digest"]
        return digest

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
