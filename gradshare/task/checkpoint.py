"""Checkpoints of a fit: `SharedTrainer(fault_tolerance=FaultTolerance(checkpoint_dir=, checkpoint_every=))` and
`fit(..., resume_from=)`.

A checkpoint is the state after the last step of an epoch E-1 (E epochs done), in
``<checkpoint_dir>/epoch-<E>/``:

    params.npy          the shared state (parameters, then persistent float buffers) with the whole log applied
                        through that step: rank 0's replica, bit-identical to the relay's (the end-of-fit
                        hash checks that)
    rank-<r>/residual.npy   worker r's residual (sub-threshold update mass not yet sent)
    rank-<r>/point.npy      with the folded local view: its point q = P + s·r, which a resume loads as it is
    rank-<r>/local.pt       torch.save of {optimizer, scheduler, rng, int_buffers} state_dicts; loaded
                            with torch.load(weights_only=True): tensors and plain values only
    rank-<r>/state.json     the threshold rule's fields, the residual's lr, τ, the loss scaler, counts
    rank-<r>.json           sha256 and size of worker r's files, written after them
    manifest.json           the job (world size, steps per epoch, batch size, seed, shapes), epochs done,
                            and sha256 + size of every file above; written LAST, by rank 0, once every
                            rank's list is there. No manifest, or a file that does not match it: the
                            checkpoint is refused whole, never half loaded.

The data position is (epochs done): each epoch's order is a function of (seed, rank, epoch) (spill.py),
so a resumed fit at epoch E reads exactly what an uninterrupted one would.

Where: checkpoint_dir (and resume_from) is a local path (or file: URI) or any Hadoop-FS URI
(stores.py). A local one is written by the workers themselves with file I/O (it must be shared by the
executors and the driver: local[N], local-cluster, a shared mount). Any other goes through Spark's
Hadoop FileSystem API on the driver: the workers stream their files to the driver's checkpoint service
(ckpt_service.py), which writes them there and serves them back for a resume or a rollback. Both paths
run the same code below on a store; files move in bounded chunks, digests are taken on the way.

A retried stage restarts at the last checkpoint of its fit (`rollback_point`, the relay's rollback).

This module is the format and the workers' side (write_rank, write_manifest, load_rank); the driver's
side (open_stores, rollback_point, the service) is driver/checkpoint.py.

Limits (documented in docs/guide/checkpoints.md): checkpoints need staleness 0 and the same steps per epoch on every
rank (so that an epoch's end is one step of the log that every rank reaches).
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from gradshare.checks import is_local
from gradshare.encoding import SharingState
from gradshare.errors import CheckpointError, TransportTimeout
from gradshare.replica.flat import FlatParams, int_buffers, load_int_buffers
from gradshare.replica.precision import Precision
from gradshare.task.apply_log import ApplyLog
from gradshare.task.ckpt_client import ServiceStore
from gradshare.task.config import CheckpointPlan, WorkerConfig
from gradshare.task.stops import StopNotes
from gradshare.task.stores import CHUNK, Digest, LocalStore, Store, error_line, read_all
from gradshare.transport.protocol.step_meta import StepMeta

FORMAT = 1
MANIFEST = "manifest.json"
PARAMS = "params.npy"
RANK_FILES = ("residual.npy", "local.pt", "state.json")  # each rank's, in rank-<r>/
POINT = "point.npy"  # a rank's folded point q (local_view.py), beside its residual where the view is folded
POLL_SECONDS = 0.05  # rank 0 polls for the other ranks' file lists
MAX_JSON = 64 << 20  # manifests, file lists, state.json: far smaller; a bigger one is not ours

# A parsed JSON object: a manifest (parse_manifest's dict, WorkerConfig.resume), a file list, state.json
Json = dict[str, Any]
T = TypeVar("T")


class Checkpointed(Protocol):
    """What a checkpoint saves and loads of a worker (task/worker.py's Worker)."""

    restored: bool  # load_rank sets it: the lr schedule and batch counters are the checkpoint's

    @property
    def rank(self) -> int: ...
    @property
    def cfg(self) -> WorkerConfig: ...
    @property
    def state(self) -> SharingState: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def flat(self) -> FlatParams: ...
    @property
    def stops(self) -> StopNotes: ...
    @property
    def log(self) -> ApplyLog | None: ...


def worker_store(cfg: WorkerConfig, source: str, rank: int) -> Store:
    """Worker `rank`'s store for "checkpoint" (cfg.checkpoint.root) or "resume" (cfg.resume's root):
    the directory itself when it is local, else the driver's service (ckpt_service.py)."""
    resume, plan = cfg.resume or {}, cfg.checkpoint
    if source == "checkpoint" and plan is None:
        raise CheckpointError("checkpoint: this fit writes none (no checkpoint_dir)")
    root: str = plan.root if source == "checkpoint" and plan is not None else resume["root"]
    service = plan.service if plan is not None else resume.get("service")
    if is_local(root):
        return LocalStore(root)
    if service is None:
        raise CheckpointError(f"checkpoint {root}: not a local directory, and no checkpoint service to reach it")
    return ServiceStore(service, cfg.job.key, source, rank, cfg.fault_tolerance.timeout, root)


def epoch_dir(epochs_done: int) -> str:
    return f"epoch-{epochs_done:05d}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def npy_chunks(array: NDArray[Any]) -> Iterator[bytes]:
    """An array as .npy bytes in chunks, straight from its memory (np.save's format, no copy of it)."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    yield header.getvalue()
    data = memoryview(array.reshape(-1).data).cast("B")
    for i in range(0, len(data), CHUNK):
        yield bytes(data[i : i + CHUNK])


class _ChunkReader:
    """A read-only file over a chunk iterator, hashing what passes (np.lib.format.read_array reads
    an array from it in bounded pieces)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        # a bytearray: appending a chunk to bytes would copy all read so far (quadratic on a whole file)
        self.chunks, self.buf, self.digest = iter(chunks), bytearray(), Digest()

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.buf) < n:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            self.buf += self.digest.update(chunk)
        end = len(self.buf) if n < 0 else n
        out = bytes(self.buf[:end])
        del self.buf[:end]
        return out

    def finish(self) -> Json:
        """Read to the end (a file longer than its array) and return the digest of it all."""
        self.read()
        return self.digest.result()


# ------------------------------------------------------------------------------------------ writing
def _jsonable_fields(obj: object, what: str) -> Json:
    """The plain fields of a rule object (floats, ints, strings, bools, None) for state.json."""
    out: Json = {}
    for name, value in vars(obj).items():
        if isinstance(value, np.generic):
            value = value.item()
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise TypeError(
                f"{what} field {name!r} holds a {type(value).__name__}: checkpoints keep plain numbers and strings only"
            )
        out[name] = value
    return out


def write_rank(plan: CheckpointPlan, epochs_done: int, worker: Checkpointed, run: int, store: Store) -> None:
    """Worker `worker.rank`'s state after its last step of epoch epochs_done-1, then its file list,
    tagged with the fit's `run` (its job id) so that rank 0 never takes an earlier fit's list."""
    directory = epoch_dir(epochs_done)
    own = f"rank-{worker.rank}"
    residual = worker.state.residual_values()  # r itself; a folded state's (q − P)/s, so files stay r
    residual = residual.detach().cpu().numpy() if hasattr(residual, "detach") else residual
    files = {f"{own}/residual.npy": store.write(f"{directory}/{own}/residual.npy", npy_chunks(residual))}
    del residual
    pair = worker.state.fold_pair()
    if pair is not None:  # the folded point q too: r = (q − P)/s and back rounds, q itself resumes exactly
        point = pair[0].detach().cpu().numpy() if hasattr(pair[0], "detach") else pair[0]
        files[f"{own}/{POINT}"] = store.write(f"{directory}/{own}/{POINT}", npy_chunks(point))
    local = {
        "optimizer": worker.optimizer.state_dict(),
        "scheduler": worker.scheduler.state_dict() if worker.scheduler is not None else None,
        "rng": torch.get_rng_state(),
        "int_buffers": int_buffers(worker.model),
    }
    buf = io.BytesIO()
    torch.save(local, buf)
    view = buf.getbuffer()
    files[f"{own}/local.pt"] = store.write(
        f"{directory}/{own}/local.pt", (bytes(view[i : i + CHUNK]) for i in range(0, len(view), CHUNK))
    )
    del view
    state = worker.state
    scaler = worker.precision.scaler
    meta = {
        "rule": _jsonable_fields(state.rule, "threshold rule"),
        "lr": state.lr,
        "lr_ref": state.lr_ref,
        "tau": state.tau,
        "silent_steps": state.silent_steps,
        "skipped_steps": worker.precision.skipped,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epochs_done": epochs_done,
        "stopping": _stopping_state(worker),
    }
    files[f"{own}/state.json"] = store.write(f"{directory}/{own}/state.json", [json.dumps(meta).encode()])
    if worker.rank == 0:
        files[PARAMS] = store.write(f"{directory}/{PARAMS}", npy_chunks(worker.flat.host_state()))
    store.write(
        f"{directory}/rank-{worker.rank}.json", [json.dumps({"run": run, "files": files}).encode()], atomic=True
    )


def _stopping_state(worker: Checkpointed) -> Json:
    """Early stopping as this rank holds it after the epoch (stopping.py; rank 0 scored it first): the
    rule's best and count, the stop request and the stop epoch the log carries, in whole-training epochs
    (a resumed fit's log counts its own from 0)."""
    first = worker.cfg.data.first_epoch
    rule = worker.stops.rule
    stop = None if worker.log is None else worker.log.stop_epoch
    return {
        "best": None if rule is None else rule.best,
        "waited": None if rule is None else rule.waited,
        "stop_requested": None if worker.stops.requested is None else worker.stops.requested + first,
        "stop_sent": worker.stops.sent,
        "stop_epoch": None if stop is None else stop + first,
        # rank 0's epoch end for its next message (its score, the rule's state): a fit resumed from
        # here sends it as the uninterrupted one does, and the relay keeps the score for the row
        "epoch_notes": _shift_val_epoch(worker.stops.notes, first).to_wire(),
    }


def _load_stopping(worker: Checkpointed, saved: Json | None) -> None:
    if not saved:  # a checkpoint of a fit without these fields
        return
    first = worker.cfg.data.first_epoch
    if worker.stops.rule is not None and saved["waited"] is not None:
        worker.stops.rule.best, worker.stops.rule.waited = saved["best"], saved["waited"]
    if saved["stop_requested"] is not None:
        worker.stops.requested, worker.stops.sent = saved["stop_requested"] - first, saved["stop_sent"]
    worker.stops.inherited = None if saved["stop_epoch"] is None else saved["stop_epoch"] - first
    notes = StepMeta.from_wire({k: float(v) for k, v in saved.get("epoch_notes", {}).items()})
    worker.stops.notes = _shift_val_epoch(notes, -first)


def _shift_val_epoch(notes: StepMeta, by: int) -> StepMeta:
    """`notes` with its scored epoch moved by `by` (the log's epochs <-> whole-training epochs)."""
    return notes if notes.val_epoch is None else dataclasses.replace(notes, val_epoch=notes.val_epoch + by)


def _file_list(store: Store, name: str, run: int) -> Json | None:
    """A rank's file list if this fit (`run`) wrote it; None while it is missing or an earlier fit's."""
    try:
        found = json.loads(read_all(store, name, MAX_JSON))
    except (FileNotFoundError, ValueError):  # not there yet (lists are replaced atomically, never half written)
        return None
    files: Json = found["files"]
    return files if found.get("run") == run else None


def write_manifest(plan: CheckpointPlan, epochs_done: int, timeout: float, run: int, store: Store) -> None:
    """Rank 0: once every rank's file list of this fit is there (at most `timeout` s), the manifest, last."""
    directory = epoch_dir(epochs_done)
    world = plan.job["world_size"]
    lists: dict[int, Json] = {}
    deadline = time.monotonic() + timeout
    while len(lists) < world:
        for r in range(world):
            if r not in lists and (found := _file_list(store, f"{directory}/rank-{r}.json", run)) is not None:
                lists[r] = found
        if len(lists) == world:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(lists))
            raise TransportTimeout(
                f"checkpoint {store.where(directory)}: rank(s) {missing} wrote no state within {timeout} s"
            )
        time.sleep(POLL_SECONDS)
    files: Json = {}
    for r in range(world):
        files.update(lists[r])
    manifest = {"format": FORMAT, "epochs_done": epochs_done, "job": plan.job, "files": files}
    store.write(f"{directory}/{MANIFEST}", [json.dumps(manifest).encode()], atomic=True)


def parse_manifest(store: Store, prefix: str, source: str) -> Json:
    """The manifest of checkpoint `prefix` in `store`, its files unchecked (a worker checks its own:
    `load_rank`). `source`: which of the fit's stores holds it ("checkpoint" or "resume": worker_store)."""
    directory = store.where(prefix)
    try:
        manifest = json.loads(read_all(store, _join(prefix, MANIFEST), MAX_JSON))
        files, job, epochs_done = manifest["files"], manifest["job"], int(manifest["epochs_done"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {MANIFEST}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: format {manifest.get('format')!r}, expected {FORMAT}")
    if PARAMS not in files or any(f"rank-{r}/{n}" not in files for r in range(job["world_size"]) for n in RANK_FILES):
        raise CheckpointError(f"checkpoint {directory}: the manifest does not list every rank's files")
    return {
        "directory": directory,
        "root": store.where(),
        "prefix": prefix,
        "source": source,
        "epochs_done": epochs_done,
        "job": job,
        "files": files,
    }


def _reader(store: Store, manifest: Json, name: str) -> _ChunkReader:
    try:
        return _ChunkReader(store.read(_join(manifest["prefix"], name)))
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {manifest['directory']}: {name} is missing") from e


def _check(manifest: Json, name: str, got: Json) -> None:
    want = manifest["files"][name]
    if got != want:
        raise CheckpointError(
            f"checkpoint {manifest['directory']}: {name} is corrupt or truncated ({got['bytes']} "
            f"bytes, sha256 {got['sha256'][:12]}…; the manifest says {want['bytes']} bytes, "
            f"{want['sha256'][:12]}…)"
        )


def _read_checked(store: Store, manifest: Json, name: str, load: Callable[[_ChunkReader], T]) -> T:
    """load(reader) on the file's stream, then its digest checked: a damaged file is an error before
    anything uses what was read."""
    reader = _reader(store, manifest, name)
    try:
        value = load(reader)
        got = reader.finish()
    except FileNotFoundError as e:  # a stream opens lazily: a missing file shows here
        raise CheckpointError(f"checkpoint {manifest['directory']}: {name} is missing") from e
    except Exception as e:  # noqa: BLE001 - bytes np/torch/json cannot parse, a Hadoop checksum error, ...
        _check(manifest, name, reader.digest.result())  # what was read: the digest says why, mostly
        raise CheckpointError(f"checkpoint {manifest['directory']}: {name} is unreadable: {error_line(e)}") from e
    _check(manifest, name, got)
    return value


def verify(store: Store, manifest: Json, name: str) -> None:
    _read_checked(store, manifest, name, lambda reader: None)


def _array(reader: _ChunkReader, limit: int) -> NDArray[Any]:
    """A .npy array from the stream, refused before allocation when its header promises more than
    `limit` bytes (the manifest's size) or Python objects."""
    fmt = np.lib.format
    version = fmt.read_magic(reader)
    read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, fortran, dtype = read_header(reader)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.hasobject or fortran or count * dtype.itemsize > limit:
        raise ValueError(f"array header {shape} {dtype} does not fit the file's {limit} bytes")
    array: NDArray[Any] = np.empty(shape, dtype)
    view = memoryview(array.reshape(-1).data).cast("B")
    for i in range(0, len(view), CHUNK):
        piece = reader.read(min(CHUNK, len(view) - i))
        if len(piece) != min(CHUNK, len(view) - i):
            raise EOFError(f"the array ends after {i + len(piece)} of {len(view)} bytes")
        view[i : i + len(piece)] = piece
    return array


def _array_of(manifest: Json, name: str) -> Callable[[_ChunkReader], NDArray[Any]]:
    return lambda reader: _array(reader, manifest["files"][name]["bytes"])


def manifest_for(cfg: WorkerConfig, epochs_done: int, rank: int) -> Json:
    """The checkpoint after `epochs_done` epochs that the relay restarted this attempt at (WELCOME's
    "checkpoint" note, `rollback_point`): the fit's resume_from, or one this fit wrote."""
    if cfg.resume is not None and cfg.resume["epochs_done"] == epochs_done:
        return cfg.resume
    if cfg.checkpoint is None:
        raise CheckpointError(
            f"the relay restarted at the checkpoint after epoch {epochs_done}, but this fit has no checkpoint_dir"
        )
    return parse_manifest(worker_store(cfg, "checkpoint", rank), epoch_dir(epochs_done), "checkpoint")


def load_params(store: Store, manifest: Json) -> NDArray[Any]:
    """The checkpoint's shared state, checked against its digest (it may have changed since it was read)."""
    return _read_checked(store, manifest, PARAMS, _array_of(manifest, PARAMS))


def sources(rank: int, saved_world: int, world: int) -> tuple[int, list[int]]:
    """Which of a checkpoint's `saved_world` ranks a rank of a fit at `world` workers starts from: (the rank whose
    optimizer, schedule, τ rule and counters it takes, the ranks whose residuals it takes the sum of). The
    same world: its own. Another: rank j takes rank j mod N's state and the residuals of the saved ranks
    r ≡ j (mod N'), so that every saved rank's unsent update mass goes to exactly one new rank and none
    is lost (a rank beyond the saved ones starts with an empty residual)."""
    return rank % saved_world, [r for r in range(saved_world) if r % world == rank]


def load_rank(manifest: Json, worker: Checkpointed) -> None:
    """Worker state from a checkpoint the driver verified; re-checked here (the files may have changed
    since), all of it before any of it is loaded. A checkpoint of another world size maps its ranks
    onto this fit's (`sources`)."""
    rank = worker.rank
    store = worker_store(worker.cfg, manifest["source"], rank)
    directory = manifest["directory"]
    saved_world = int(manifest["job"]["world_size"])
    own, summed = sources(rank, saved_world, worker.cfg.job.world_size)
    state = worker.state
    residual: NDArray[Any] | None = None
    for r in summed:  # in rank order: every rank of this fit adds them the same way
        name = f"rank-{r}/residual.npy"
        part = _read_checked(store, manifest, name, _array_of(manifest, name))
        if part.shape != (state.n_params,):
            raise CheckpointError(
                f"checkpoint {directory}: rank {r}'s residual has shape {part.shape}, the model ({state.n_params},)"
            )
        if residual is None:
            residual = part
        else:
            residual += part
    if residual is None:  # a rank beyond the saved ones: nothing of theirs to carry
        residual = np.zeros(state.n_params, np.float32)
    # torch.load needs a seekable file: the optimizer state's bytes are held once, as torch.load's input
    local = _read_checked(
        store, manifest, f"rank-{own}/local.pt", lambda reader: torch.load(io.BytesIO(reader.read()), weights_only=True)
    )
    meta: Json = _read_checked(store, manifest, f"rank-{own}/state.json", lambda reader: json.loads(reader.read()))
    point = f"rank-{rank}/{POINT}"
    if state.folded and saved_world == worker.cfg.job.world_size and point in manifest["files"]:
        state.load_point(_read_checked(store, manifest, point, _array_of(manifest, point)))
    else:  # folded: onto the parameters the relay's snapshot just loaded
        state.load_residual(residual)
    del residual
    worker.optimizer.load_state_dict(local["optimizer"])
    if worker.scheduler is not None and local["scheduler"] is not None:
        worker.scheduler.load_state_dict(local["scheduler"])
    if own == rank:  # a rank beyond the saved ones keeps its own seed: no two ranks draw the same dropout
        torch.set_rng_state(local["rng"])
    load_int_buffers(worker.model, local["int_buffers"])
    for name, value in meta["rule"].items():
        setattr(state.rule, name, value)
    state.lr, state.lr_ref, state.tau = meta["lr"], meta["lr_ref"], meta["tau"]
    if own == rank:  # this rank's own counts; another rank's are not its history
        state.silent_steps, worker.precision.skipped = meta["silent_steps"], meta["skipped_steps"]
    if worker.precision.scaler is not None and meta["scaler"] is not None:
        worker.precision.scaler.load_state_dict(meta["scaler"])
    _load_stopping(worker, meta.get("stopping"))
    worker.restored = True  # its lr schedule and batch counters are the checkpoint's (Worker.run)
