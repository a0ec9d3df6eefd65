"""Where checkpoint files live (checkpoint.py): one small interface, three ways to reach a directory.

    LocalStore(root)          a local directory (or file: URI): plain file I/O, the fast direct path
    HadoopStore(spark, root)  any Hadoop-FS URI (hdfs://, s3a://, abfs://, viewfs://, ...), through
                              Spark's JVM FileSystem API; only the driver has one (executors have no
                              JVM gateway), so workers reach it through the driver (ckpt_service.py)
    ServiceStore(...)         ckpt_service.ServiceStore: a worker's view of a driver's store

Names are '/'-separated paths relative to the store's root. Data moves in chunks of at most CHUNK
bytes, so no file is held whole in one buffer beyond what its writer or reader holds anyway; `digest`
of the bytes written is computed on the way. HadoopStore spools each file through a temporary file on
the driver's disk for the one operation (see its `write`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from gradshare.checks import local_root

if TYPE_CHECKING:
    from pyspark import SparkContext

CHUNK = 1 << 20


def file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


class Digest:
    """sha256 and size of a byte stream, fed chunk by chunk."""

    def __init__(self) -> None:
        self.h, self.size = hashlib.sha256(), 0

    def update(self, chunk: bytes) -> bytes:
        self.h.update(chunk)
        self.size += len(chunk)
        return chunk

    def result(self) -> dict[str, Any]:
        return {"sha256": self.h.hexdigest(), "bytes": self.size}


class Store(Protocol):
    """What every store does (LocalStore, HadoopStore, ckpt_client.ServiceStore)."""

    def where(self, name: str = "") -> str: ...
    def write(self, name: str, chunks: Iterable[bytes], atomic: bool = False) -> dict[str, Any]: ...
    def read(self, name: str) -> Iterator[bytes]: ...
    def exists(self, name: str) -> bool: ...
    def list(self, name: str = "") -> list[str]: ...
    def is_dir(self, name: str = "") -> bool: ...
    def makedirs(self, name: str = "") -> None: ...


class LocalStore:
    def __init__(self, root: str):
        self.root = local_root(root)

    def where(self, name: str = "") -> str:
        return os.path.join(self.root, *[p for p in name.split("/") if p])

    def write(self, name: str, chunks: Iterable[bytes], atomic: bool = False) -> dict[str, Any]:
        path = self.where(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        digest = Digest()
        target = f"{path}.tmp-{os.getpid()}" if atomic else path
        with open(target, "wb") as f:
            for chunk in chunks:
                f.write(digest.update(chunk))
            if atomic:
                f.flush()
                os.fsync(f.fileno())
        if atomic:
            os.replace(target, path)
        return digest.result()

    def read(self, name: str) -> Iterator[bytes]:
        """The file's bytes in chunks; FileNotFoundError when it is not there."""
        return file_chunks(self.where(name))

    def exists(self, name: str) -> bool:
        return os.path.exists(self.where(name))

    def list(self, name: str = "") -> list[str]:
        path = self.where(name)
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def is_dir(self, name: str = "") -> bool:
        return os.path.isdir(self.where(name))

    def makedirs(self, name: str = "") -> None:
        os.makedirs(self.where(name), exist_ok=True)

    def remove(self, name: str) -> None:
        os.remove(self.where(name))


class HadoopStore:
    """A directory of any Hadoop FileSystem, through the driver's JVM (gradshare/ml/persist.py does the
    same for saved models). Only usable on the driver."""

    def __init__(self, spark_context: SparkContext, root: str) -> None:
        self.root = root.rstrip("/")
        jvm = spark_context._jvm
        assert jvm is not None  # the driver's SparkContext of a classic session runs a JVM
        self._path = jvm.org.apache.hadoop.fs.Path
        self.fs = self._path(self.root).getFileSystem(spark_context._jsc.hadoopConfiguration())

    def where(self, name: str = "") -> str:
        return "/".join([self.root, *[p for p in name.split("/") if p]])

    def _p(self, name: str) -> Any:  # a py4j proxy of a Hadoop Path
        return self._path(self.where(name))

    # Data does not cross Py4J: its byte arrays travel base64-encoded through the gateway socket (a
    # checkpoint of the 10.5 M MLP took 6.3 s a rank that way, against 0.9 s on the direct path). A file
    # is spooled, in chunks, to a local temporary file on the driver and Hadoop copies it from there
    # (copyFromLocalFile / copyToLocalFile), so the bytes move inside the JVM. The spool file lives only
    # for the one operation; memory stays at one chunk.
    def write(self, name: str, chunks: Iterable[bytes], atomic: bool = False) -> dict[str, Any]:
        digest = Digest()
        fd, spool = tempfile.mkstemp(prefix="gradshare-ckpt-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(digest.update(chunk))
            final = self._p(name)
            target = self._p(f"{name}.tmp-{uuid.uuid4().hex}") if atomic else final
            self.fs.copyFromLocalFile(True, True, self._path(f"file://{spool}"), target)  # deletes the spool
            if atomic:  # Hadoop's rename does not replace: the old file goes first (a reader polls for it)
                if self.fs.exists(final):
                    self.fs.delete(final, False)
                if not self.fs.rename(target, final):
                    raise OSError(f"could not rename {target.toString()} to {self.where(name)}")
        finally:
            if os.path.exists(spool):
                os.remove(spool)
        return digest.result()

    def read(self, name: str) -> Iterator[bytes]:
        p = self._p(name)
        if not self.fs.exists(p):
            raise FileNotFoundError(f"{self.where(name)} does not exist")
        fd, spool = tempfile.mkstemp(prefix="gradshare-ckpt-")
        os.close(fd)
        try:
            self.fs.copyToLocalFile(False, p, self._path(f"file://{spool}"), True)  # raw: no .crc beside it
            yield from file_chunks(spool)
        finally:
            os.remove(spool)

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self._p(name)))

    def list(self, name: str = "") -> list[str]:
        p = self._p(name)
        if not self.fs.exists(p) or not self.fs.getFileStatus(p).isDirectory():
            return []
        return sorted(s.getPath().getName() for s in self.fs.listStatus(p))

    def is_dir(self, name: str = "") -> bool:
        p = self._p(name)
        return bool(self.fs.exists(p) and self.fs.getFileStatus(p).isDirectory())

    def makedirs(self, name: str = "") -> None:
        if not self.fs.mkdirs(self._p(name)):
            raise OSError(f"could not create {self.where(name)}")

    def remove(self, name: str) -> None:
        self.fs.delete(self._p(name), False)


def error_line(e: BaseException) -> str:
    """The cause in one line; for a Py4J error, the Java exception (Py4J's own first line is "An error
    occurred while calling o65.getFileSystem")."""
    java = getattr(e, "java_exception", None)
    text = str(java.toString()) if java is not None else str(e)
    return (text.strip().splitlines() or [type(e).__name__])[0][:300]


def read_all(store: Store, name: str, limit: int) -> bytes:
    """A small file whole (manifests, file lists, state.json), refusing one over `limit` bytes."""
    out = bytearray()
    for chunk in store.read(name):
        out += chunk
        if len(out) > limit:
            raise ValueError(f"{store.where(name)} is over {limit} bytes")
    return bytes(out)
