"""The driver's checkpoint service (ckpt_service.py): what workers send to a Hadoop-FS checkpoint_dir and
read back from it. Authenticated with the job key, bounded frames, bounded waits that name rank and file."""

import os
import socket
import time

import numpy as np
import pytest

from gradshare.driver.ckpt_service import CheckpointService
from gradshare.errors import CheckpointError, RemoteProtocolError, TransportTimeout
from gradshare.task.checkpoint import npy_chunks
from gradshare.task.ckpt_client import MAX_FRAME, Sealed, ServiceStore
from gradshare.task.stores import CHUNK, Digest, LocalStore
from gradshare.transport import new_job_key


@pytest.fixture
def service(tmp_path):
    key = new_job_key()
    with CheckpointService({"checkpoint": LocalStore(str(tmp_path))}, key, "127.0.0.1", timeout=5.0).start() as s:
        yield s, key, tmp_path


def _store(service, key=None, timeout=5.0):
    s, job_key, _ = service
    return ServiceStore(s.address, key or job_key, "checkpoint", 1, timeout, "viewfs://x/ckpt")


@pytest.mark.sockets
def test_files_stream_through_in_bounded_chunks_and_come_back_whole(service):
    store = _store(service)
    array = np.random.default_rng(0).standard_normal(700_000).astype(np.float32)  # 2.8 MB: several frames
    sent = store.write("epoch-00001/rank-1/residual.npy", npy_chunks(array))
    path = os.path.join(service[2], "epoch-00001", "rank-1", "residual.npy")
    assert np.array_equal(np.load(path), array) and sent["bytes"] == os.path.getsize(path)
    chunks = list(store.read("epoch-00001/rank-1/residual.npy"))
    assert max(len(c) for c in chunks) <= CHUNK and len(chunks) >= 3
    digest = Digest()
    for c in chunks:
        digest.update(c)
    assert digest.result() == sent
    store.write("epoch-00001/rank-1.json", [b'{"a": 1}'], atomic=True)
    store.write("epoch-00001/rank-1.json", [b'{"a": 2}'], atomic=True)  # replaced whole
    assert b"".join(store.read("epoch-00001/rank-1.json")) == b'{"a": 2}'
    assert store.list() == ["epoch-00001"] and store.list("epoch-00001") == ["rank-1", "rank-1.json"]
    assert store.exists("epoch-00001/rank-1.json") and not store.exists("nope") and store.is_dir("epoch-00001")
    with pytest.raises(FileNotFoundError, match="rank 1's checkpoint read of viewfs://x/ckpt/nope"):
        b"".join(store.read("nope"))


@pytest.mark.sockets
def test_another_jobs_key_and_names_outside_the_store_are_refused(service):
    s, key, root = service
    with pytest.raises(CheckpointError, match="rank 1's checkpoint write of viewfs://x/ckpt/x.bin"):
        _store(service, key=new_job_key()).write("x.bin", [b"forged"])
    assert not os.path.exists(os.path.join(root, "x.bin"))
    store = _store(service)
    for name in ("../outside", "/etc/passwd", "a/./b"):
        with pytest.raises(CheckpointError, match="bad checkpoint file name"):
            store.exists(name)
    deadline = time.monotonic() + 5
    while len(s.errors) < 4 and time.monotonic() < deadline:  # the server notes them after answering
        time.sleep(0.01)
    assert "authentication" in s.errors[0]


@pytest.mark.sockets
def test_an_oversized_frame_is_refused_before_it_is_read(service):
    s, key, _ = service
    sock = socket.create_connection(s.address, timeout=5)
    sock.recv(7)
    sock.sendall((MAX_FRAME + 1).to_bytes(4, "little"))
    assert sock.recv(10) == b""  # the service hangs up without reading 1 MB of it
    sock.close()
    deadline = time.monotonic() + 5
    while not s.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f"> {MAX_FRAME}" in s.errors[0]


@pytest.mark.sockets
def test_a_driver_that_does_not_answer_is_a_timeout_naming_rank_and_file():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections (backlog), never answers
    try:
        store = ServiceStore(silent.getsockname()[:2], new_job_key(), "checkpoint", 3, 0.3, "viewfs://x/ckpt")
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match=r"rank 3's checkpoint write of viewfs://x/ckpt/a.npy .* 0.3 s"):
            store.write("a.npy", [b"x"])
        assert time.monotonic() - t0 < 3
    finally:
        silent.close()


def test_frames_are_sealed_per_connection():
    """A frame of one connection does not open on another (each has the server's own random salt)."""
    a, b = socket.socketpair()
    key = new_job_key()
    try:
        Sealed(a, key, b"1234567", b"C").send(b"hello")
        assert Sealed(b, key, b"1234567", b"S").receive() == b"hello"
        Sealed(a, key, b"1234567", b"C").send(b"hello")
        with pytest.raises(RemoteProtocolError, match="authentication"):
            Sealed(b, key, b"7654321", b"S").receive()
    finally:
        a.close()
        b.close()
