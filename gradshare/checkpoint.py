"""Checkpoints of a fit (issue 14, item 3): `SharedTrainer(checkpoint_dir=, checkpoint_every=)` and
`fit(..., resume_from=)`.

A checkpoint is the state after the last step of an epoch E-1 (E epochs done), in
``<checkpoint_dir>/epoch-<E>/``:

    params.npy          the shared state (parameters, then float buffers) with the whole log applied
                        through that step: rank 0's replica, bit-identical to the relay's (the end-of-fit
                        hash checks that)
    rank-<r>/residual.npy   worker r's residual (sub-threshold update mass not yet sent)
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

Limits (documented in the README): workers write their own state with local file I/O, so
checkpoint_dir must be a local path (or file: URI) that the executors share with the driver (true for
local[N] and local-cluster); checkpoints need staleness 0 and the same steps per epoch on every rank (so
that an epoch's end is one step of the log that every rank reaches).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np

from gradshare.errors import CheckpointError, TransportTimeout
from gradshare.flat import int_buffers, load_int_buffers

FORMAT = 1
MANIFEST = "manifest.json"
PARAMS = "params.npy"
POLL_SECONDS = 0.05  # rank 0 polls for the other ranks' file lists


@dataclass(frozen=True)
class CheckpointPlan:
    """What the workers need to write checkpoints; shipped in WorkerConfig."""

    root: str  # a local directory
    every: int  # epochs between checkpoints (the fit's last epoch always writes one)
    job: dict  # `job_of`: compared on resume


def local_dir(path, argument: str) -> str:
    """`path` as a local directory name; a URI of another filesystem is refused (module docstring)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a path or file: URI, got {type(path).__name__}")
    path = os.fspath(path)
    parsed = urlparse(path)
    if parsed.scheme == "file":
        return parsed.path
    if parsed.scheme and len(parsed.scheme) > 1:  # "C:" is a drive, not a scheme
        raise ValueError(f"{argument}={path!r}: only local paths and file: URIs are supported (workers write "
                         "their state with local file I/O, so the directory must be shared by the executors)")
    return os.path.abspath(path)


def check_writable(root: str) -> None:
    """Create `root` and write a probe file in it: a checkpoint_dir we cannot write fails before training."""
    probe = os.path.join(root, f".gradshare-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"checkpoint_dir={root!r} is not writable: {e}") from e


def check_fresh(root: str, epochs_done: int) -> None:
    """A fit writes epoch-<E> for E > epochs_done: refuse to mix its files with an earlier fit's there."""
    taken = sorted(n for n in os.listdir(root) if n.startswith("epoch-") and n[6:].isdigit()
                   and int(n[6:]) > epochs_done)
    if taken:
        raise ValueError(f"checkpoint_dir={root!r} already holds {', '.join(taken)}, which this fit would overwrite; "
                         "give an empty directory, or remove them")


def job_of(world_size: int, steps_per_epoch: tuple, batch_size: int, seed: int, shapes: list) -> dict:
    """The facts a checkpoint must share with the fit that resumes from it."""
    return {"world_size": world_size, "steps_per_epoch": list(steps_per_epoch), "batch_size": batch_size,
            "seed": seed, "shapes": [[name, list(shape)] for name, shape in shapes]}


def epoch_dir(root: str, epochs_done: int) -> str:
    return os.path.join(root, f"epoch-{epochs_done:05d}")


def _digest(path: str) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ writing
def _jsonable_fields(obj, what: str) -> dict:
    """The plain fields of a rule object (floats, ints, strings, bools, None) for state.json."""
    out = {}
    for name, value in vars(obj).items():
        if isinstance(value, np.generic):
            value = value.item()
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise TypeError(f"{what} field {name!r} holds a {type(value).__name__}: checkpoints keep plain "
                            "numbers and strings only")
        out[name] = value
    return out


def write_rank(plan: CheckpointPlan, epochs_done: int, worker, run: int) -> None:
    """Worker `worker.rank`'s state after its last step of epoch epochs_done-1, then its file list,
    tagged with the fit's `run` (its job id) so that rank 0 never takes an earlier fit's list."""
    import io

    import torch

    directory = epoch_dir(plan.root, epochs_done)
    own = os.path.join(directory, f"rank-{worker.rank}")
    os.makedirs(own, exist_ok=True)
    residual = worker.state.residual
    residual = residual.detach().cpu().numpy() if hasattr(residual, "detach") else residual
    with open(os.path.join(own, "residual.npy"), "wb") as f:
        np.save(f, residual, allow_pickle=False)
    local = {"optimizer": worker.optimizer.state_dict(),
             "scheduler": worker.scheduler.state_dict() if worker.scheduler is not None else None,
             "rng": torch.get_rng_state(),
             "int_buffers": int_buffers(worker.model)}
    buf = io.BytesIO()
    torch.save(local, buf)
    with open(os.path.join(own, "local.pt"), "wb") as f:
        f.write(buf.getvalue())
    state = worker.state
    scaler = worker.precision.scaler
    meta = {"rule": _jsonable_fields(state.rule, "threshold rule"), "lr": state.lr, "lr_ref": state.lr_ref,
            "tau": state.tau, "silent_steps": state.silent_steps, "skipped_steps": worker.precision.skipped,
            "scaler": scaler.state_dict() if scaler is not None else None, "epochs_done": epochs_done,
            "stopping": _stopping_state(worker)}
    with open(os.path.join(own, "state.json"), "w") as f:
        json.dump(meta, f)
    if worker.rank == 0:
        with open(os.path.join(directory, PARAMS), "wb") as f:
            np.save(f, worker.flat.host_state(), allow_pickle=False)
    files = {os.path.relpath(os.path.join(own, n), directory): _digest(os.path.join(own, n))
             for n in ("residual.npy", "local.pt", "state.json")}
    if worker.rank == 0:
        files[PARAMS] = _digest(os.path.join(directory, PARAMS))
    _write_atomic(os.path.join(directory, f"rank-{worker.rank}.json"), json.dumps({"run": run, "files": files}).encode())


def _stopping_state(worker) -> dict:
    """Early stopping as this rank holds it after the epoch (stopping.py; rank 0 scored it first): the
    rule's best and count, the stop request and the stop epoch the log carries, in whole-training epochs
    (a resumed fit's log counts its own from 0)."""
    first = worker.cfg.first_epoch
    rule = worker.stopper
    return {"best": None if rule is None else rule.best, "waited": None if rule is None else rule.waited,
            "stop_requested": None if worker.stop_requested is None else worker.stop_requested + first,
            "stop_sent": worker.stop_sent,
            "stop_epoch": None if worker.log.stop_epoch is None else worker.log.stop_epoch + first,
            # rank 0's epoch end for its next message (its score, the rule's state): a fit resumed from
            # here sends it as the uninterrupted one does, and the relay keeps the score for the row
            "epoch_notes": {k: v + first if k == "val_epoch" else v for k, v in worker.epoch_notes.items()}}


def _load_stopping(worker, saved: dict | None) -> None:
    if not saved:  # a checkpoint of a fit without these fields
        return
    first = worker.cfg.first_epoch
    if worker.stopper is not None and saved["waited"] is not None:
        worker.stopper.best, worker.stopper.waited = saved["best"], saved["waited"]
    if saved["stop_requested"] is not None:
        worker.stop_requested, worker.stop_sent = saved["stop_requested"] - first, saved["stop_sent"]
    worker.inherited_stop = None if saved["stop_epoch"] is None else saved["stop_epoch"] - first
    worker.epoch_notes = {k: v - first if k == "val_epoch" else v for k, v in saved.get("epoch_notes", {}).items()}


def _file_list(path: str, run: int) -> dict | None:
    """A rank's file list if this fit (`run`) wrote it; None while it is missing or an earlier fit's."""
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):  # not there yet (lists are replaced atomically, never half written)
        return None
    return found["files"] if found.get("run") == run else None


def write_manifest(plan: CheckpointPlan, epochs_done: int, timeout: float, run: int) -> None:
    """Rank 0: once every rank's file list of this fit is there (at most `timeout` s), the manifest, last."""
    directory = epoch_dir(plan.root, epochs_done)
    world = plan.job["world_size"]
    lists: dict = {}
    deadline = time.monotonic() + timeout
    while len(lists) < world:
        for r in range(world):
            if r not in lists and (found := _file_list(os.path.join(directory, f"rank-{r}.json"), run)) is not None:
                lists[r] = found
        if len(lists) == world:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(lists))
            raise TransportTimeout(f"checkpoint {directory}: rank(s) {missing} wrote no state within {timeout} s")
        time.sleep(POLL_SECONDS)
    files = {}
    for r in range(world):
        files.update(lists[r])
    manifest = {"format": FORMAT, "epochs_done": epochs_done, "job": plan.job, "files": files}
    _write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest).encode())


# ------------------------------------------------------------------------------------------ reading
def find(path) -> str:
    """The checkpoint `resume_from` names: a directory with a manifest, or a checkpoint_dir (its latest
    checkpoint that has one)."""
    path = local_dir(path, "resume_from")
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"resume_from={path!r} does not exist")
    done = sorted(n for n in os.listdir(path) if n.startswith("epoch-")
                  and os.path.exists(os.path.join(path, n, MANIFEST)))
    if not done:
        raise CheckpointError(f"resume_from={path!r} holds no complete checkpoint (no {MANIFEST}; one is "
                                "written last, so a checkpoint cut short has none)")
    return os.path.join(path, done[-1])


def read_manifest(directory: str) -> dict:
    """The manifest of `directory`, with every file it lists checked against its size and sha256."""
    manifest = parse_manifest(directory)
    for name, want in manifest["files"].items():
        verify(directory, name, want)
    return manifest


def parse_manifest(directory: str) -> dict:
    """The manifest of `directory`, its files unchecked (a worker checks its own: `load_rank`)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        files, job, epochs_done = manifest["files"], manifest["job"], int(manifest["epochs_done"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {MANIFEST}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: format {manifest.get('format')!r}, expected {FORMAT}")
    if PARAMS not in files or any(f"rank-{r}/state.json" not in files for r in range(job["world_size"])):
        raise CheckpointError(f"checkpoint {directory}: the manifest does not list every rank's files")
    return {"directory": directory, "epochs_done": epochs_done, "job": job, "files": files}


def verify(directory: str, name: str, want: dict) -> None:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {directory}: {name} is missing")
    got = _digest(path)
    if got != want:
        raise CheckpointError(f"checkpoint {directory}: {name} is corrupt or truncated ({got['bytes']} bytes, "
                                f"sha256 {got['sha256'][:12]}…; the manifest says {want['bytes']} bytes, "
                                f"{want['sha256'][:12]}…)")


def check_job(manifest: dict, job: dict) -> None:
    """The resumed fit must be the checkpoint's job: the same shapes, workers, batches and seed."""
    have, want = manifest["job"], job
    where = manifest["directory"]
    if have["shapes"] != want["shapes"]:
        theirs = {n: tuple(s) for n, s in have["shapes"]}
        ours = {n: tuple(s) for n, s in want["shapes"]}
        # the first entry, in the model's order, whose shape differs (or that only one side has)
        name = next((n for n in [*ours, *theirs] if theirs.get(n) != ours.get(n)), "?")
        raise ValueError(f"resume_from={where!r} is a checkpoint of another model: {name} has shape "
                         f"{theirs.get(name, 'none')} there and {ours.get(name, 'none')} in this model "
                         f"(checkpoint shapes {theirs}; model shapes {ours})")
    for key in ("world_size", "steps_per_epoch", "batch_size", "seed"):
        if have[key] != want[key]:
            raise ValueError(f"resume_from={where!r} is a checkpoint of another job: its {key} is {have[key]!r}, "
                             f"this fit's is {want[key]!r}")


def manifest_for(cfg, epochs_done: int) -> dict:
    """The checkpoint after `epochs_done` epochs that the relay restarted this attempt at (WELCOME's
    "checkpoint" note, `rollback_point`): the fit's resume_from, or one this fit wrote."""
    if cfg.resume is not None and cfg.resume["epochs_done"] == epochs_done:
        return cfg.resume
    if cfg.checkpoint is None:
        raise CheckpointError(f"the relay restarted at the checkpoint after epoch {epochs_done}, but this fit "
                              "has no checkpoint_dir")
    return parse_manifest(epoch_dir(cfg.checkpoint.root, epochs_done))


def rollback_point(plan: CheckpointPlan | None, resume: dict | None, first_epoch: int, steps_per_epoch: int,
                   complete_through: int):
    """RelayCore's `rollback` for a fit with checkpoints: the latest complete checkpoint of this fit whose
    step the relay's log has reached (or the fit's resume_from, at step -1), as (step the log holds it
    through, parameters, epochs done in this fit's log, whole-training epochs done); None without one.

    A checkpoint that does not read back whole (a file missing, truncated or changed) is passed over
    for the one before it: a retried stage never starts from half a checkpoint."""
    candidates = []
    if plan is not None and os.path.isdir(plan.root):
        done = sorted((int(n[6:]) for n in os.listdir(plan.root) if n.startswith("epoch-") and n[6:].isdigit()),
                      reverse=True)
        candidates = [epoch_dir(plan.root, e) for e in done
                      if e > first_epoch and (e - first_epoch) * steps_per_epoch - 1 <= complete_through]
    for directory in candidates:
        try:
            manifest = read_manifest(directory)
            if manifest["job"] != plan.job:
                continue
            return _point(manifest, first_epoch, steps_per_epoch)
        except CheckpointError:
            continue  # cut short (no manifest yet) or damaged: the one before it
    if resume is not None:
        return _point(resume, first_epoch, steps_per_epoch)
    return None


def _point(manifest: dict, first_epoch: int, steps_per_epoch: int):
    verify(manifest["directory"], PARAMS, manifest["files"][PARAMS])  # it may have changed since it was read
    local = manifest["epochs_done"] - first_epoch
    return local * steps_per_epoch - 1, load_params(manifest), local, manifest["epochs_done"]


def load_params(manifest: dict) -> np.ndarray:
    with open(os.path.join(manifest["directory"], PARAMS), "rb") as f:
        return np.load(f, allow_pickle=False)


def load_rank(resume: dict, worker) -> None:
    """Worker state from a checkpoint the driver verified; re-checked here (the files may have changed
    since), all of it before any of it is loaded."""
    import io

    import torch

    directory, rank = resume["directory"], worker.rank
    names = [f"rank-{rank}/{n}" for n in ("residual.npy", "local.pt", "state.json")]
    blobs = {}
    for name in names:
        verify(directory, name, resume["files"][name])
        with open(os.path.join(directory, name), "rb") as f:
            blobs[name] = f.read()
    residual = np.load(io.BytesIO(blobs[names[0]]), allow_pickle=False)
    local = torch.load(io.BytesIO(blobs[names[1]]), weights_only=True)
    meta = json.loads(blobs[names[2]])
    state = worker.state
    if residual.shape != tuple(state.residual.shape):
        raise CheckpointError(f"checkpoint {directory}: rank {rank}'s residual has shape {residual.shape}, "
                                f"the model {tuple(state.residual.shape)}")
    if isinstance(state.residual, np.ndarray):
        np.copyto(state.residual, residual)
    else:
        state.residual.copy_(torch.from_numpy(residual))
    worker.optimizer.load_state_dict(local["optimizer"])
    if worker.scheduler is not None and local["scheduler"] is not None:
        worker.scheduler.load_state_dict(local["scheduler"])
    torch.set_rng_state(local["rng"])
    load_int_buffers(worker.model, local["int_buffers"])
    for name, value in meta["rule"].items():
        setattr(state.rule, name, value)
    state.lr, state.lr_ref, state.tau, state.silent_steps = meta["lr"], meta["lr_ref"], meta["tau"], meta["silent_steps"]
    worker.precision.skipped = meta["skipped_steps"]
    if worker.precision.scaler is not None and meta["scaler"] is not None:
        worker.precision.scaler.load_state_dict(meta["scaler"])
    _load_stopping(worker, meta.get("stopping"))
    worker.restored = True  # its lr schedule and batch counters are the checkpoint's (Worker.run)
