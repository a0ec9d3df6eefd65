"""The driver's side of checkpoints (the format and the workers' side: task/checkpoint.py).

Before any Spark job: checkpoint_dir checked writable and free of a later fit's epochs, resume_from's
manifest found and every file of it verified, the job compared (`open_stores`, `check_job`), and the
driver's checkpoint service started when a store is not local (`start_service`, driver/ckpt_service.py).
During the fit: the relay's rollback for a retried stage (`rollback_point`): the latest complete
checkpoint of this fit that the relay's log has reached.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias

from gradshare.checks import checkpoint_root, is_local
from gradshare.driver.ckpt_service import CheckpointService
from gradshare.errors import CheckpointError
from gradshare.task.checkpoint import MANIFEST, PARAMS, epoch_dir, load_params, parse_manifest, verify
from gradshare.task.config import CheckpointPlan
from gradshare.task.stores import HadoopStore, LocalStore, Store, error_line
from gradshare.task.tallies import RollbackPoint

if TYPE_CHECKING:
    from pyspark import SparkContext

# a checkpoint's manifest (task/checkpoint.py: JSON, read by key), and the driver's stores by source
Manifest: TypeAlias = dict[str, Any]
DriverStore: TypeAlias = "LocalStore | HadoopStore"
Stores: TypeAlias = "dict[str, DriverStore]"


def driver_store(root: str, spark_context: SparkContext | None) -> DriverStore:
    """The driver's store for `root`: local file I/O, or Spark's Hadoop FileSystem API."""
    if is_local(root):
        return LocalStore(root)
    if spark_context is None:  # a Connect session: no JVM of ours to reach Hadoop's FileSystem through
        raise ValueError(
            f"{root!r} is not a local directory, and this Spark session has no SparkContext "
            "to reach it through Hadoop's FileSystem API"
        )
    return HadoopStore(spark_context, root)


def check_writable(store: DriverStore) -> None:
    """Create the root and write a probe file in it: a checkpoint_dir we cannot write fails before training."""
    probe = f".gradshare-probe-{os.getpid()}"
    try:
        store.makedirs()
        store.write(probe, [b"ok"])
        store.remove(probe)
    except Exception as e:  # noqa: BLE001 - OSError locally; a Py4J error wrapping Java's IOException otherwise
        raise ValueError(f"checkpoint_dir={store.where()!r} is not writable: {error_line(e)}") from e


def _epochs_in(store: Store) -> list[int]:
    return sorted(int(n[6:]) for n in store.list() if n.startswith("epoch-") and n[6:].isdigit())


def check_fresh(store: Store, epochs_done: int) -> None:
    """A fit writes epoch-<E> for E > epochs_done: refuse to mix its files with an earlier fit's there."""
    taken = [epoch_dir(e) for e in _epochs_in(store) if e > epochs_done]
    if taken:
        raise ValueError(
            f"checkpoint_dir={store.where()!r} already holds {', '.join(taken)}, which this fit would "
            "overwrite; give an empty directory, or remove them"
        )


def job_of(
    world_size: int,
    steps_per_epoch: tuple[int, ...],
    batch_size: int,
    seed: int,
    shapes: list[tuple[str, tuple[int, ...]]],
    step_cap: float | None = None,
    step_shares: list[list[float]] | None = None,
) -> dict[str, Any]:
    """The facts a checkpoint must share with the fit that resumes from it, and the step cap's shares,
    which a resumed fit takes from it (which tensors are capped comes from the training's first parameters)."""
    return {
        "world_size": world_size,
        "steps_per_epoch": list(steps_per_epoch),
        "batch_size": batch_size,
        "seed": seed,
        "shapes": [[name, list(shape)] for name, shape in shapes],
        "step_cap": step_cap,
        "step_shares": step_shares,
    }


# ------------------------------------------------------------------------------------------ reading
def find(store: Store) -> str:
    """The checkpoint in `store` (resume_from's): "" when its root holds a manifest, else its latest
    epoch-<E> that has one (a checkpoint_dir)."""
    if store.exists(MANIFEST):
        return ""
    if not store.is_dir():
        raise FileNotFoundError(f"resume_from={store.where()!r} does not exist")
    done = [epoch_dir(e) for e in _epochs_in(store) if store.exists(f"{epoch_dir(e)}/{MANIFEST}")]
    if not done:
        raise CheckpointError(
            f"resume_from={store.where()!r} holds no complete checkpoint (no {MANIFEST}; one is "
            "written last, so a checkpoint cut short has none)"
        )
    return done[-1]


def read_manifest(store: Store, prefix: str, source: str) -> Manifest:
    """The manifest of checkpoint `prefix` in `store`, with every file it lists checked against its size
    and sha256."""
    manifest = parse_manifest(store, prefix, source)
    for name in manifest["files"]:
        verify(store, manifest, name)
    return manifest


def check_job(manifest: Manifest, job: dict[str, Any]) -> None:
    """The resumed fit must be the checkpoint's job: the same shapes and seed, and at the same world size the
    same steps per epoch and batch size (a resume at another world size re-forms the job)."""
    have, want = manifest["job"], job
    where = manifest["directory"]
    if have["shapes"] != want["shapes"]:
        theirs = {n: tuple(s) for n, s in have["shapes"]}
        ours = {n: tuple(s) for n, s in want["shapes"]}
        # the first entry, in the model's order, whose shape differs (or that only one side has)
        name = next((n for n in [*ours, *theirs] if theirs.get(n) != ours.get(n)), "?")
        raise ValueError(
            f"resume_from={where!r} is a checkpoint of another model: {name} has shape "
            f"{theirs.get(name, 'none')} there and {ours.get(name, 'none')} in this model "
            f"(checkpoint shapes {theirs}; model shapes {ours})"
        )
    # another world size is a re-formed job (task/checkpoint.sources maps the ranks): its steps per epoch
    # follow, and its per-worker batch may have been rescaled to keep the global batch
    regrouped = have.get("world_size") != want.get("world_size")
    keys = ("seed", "step_cap") if regrouped else ("world_size", "steps_per_epoch", "batch_size", "seed", "step_cap")
    for key in keys:
        if have.get(key) != want.get(key):
            raise ValueError(
                f"resume_from={where!r} is a checkpoint of another job: its {key} is {have.get(key)!r}, "
                f"this fit's is {want.get(key)!r}"
            )


def rollback_point(
    plan: CheckpointPlan | None,
    resume: Manifest | None,
    stores: Stores,
    first_epoch: int,
    steps_per_epoch: int,
    complete_through: int,
) -> RollbackPoint | None:
    """RelayCore's `rollback` for a fit with checkpoints: the latest complete checkpoint of this fit whose
    step the relay's log has reached (or the fit's resume_from, at step -1), as (step the log holds it
    through, parameters, epochs done in this fit's log, whole-training epochs done); None without one.
    `stores`: the driver's, by source ("checkpoint", "resume").

    A checkpoint that does not read back whole (a file missing, truncated or changed) is passed over
    for the one before it: a retried stage never starts from half a checkpoint."""
    if plan is not None:
        store = stores["checkpoint"]
        for e in reversed(_epochs_in(store)):
            if e <= first_epoch or (e - first_epoch) * steps_per_epoch - 1 > complete_through:
                continue
            try:
                manifest = parse_manifest(store, epoch_dir(e), "checkpoint")
                if manifest["job"] == plan.job:
                    for name in manifest["files"]:  # the parameters are checked as _point loads them
                        if name != PARAMS:
                            verify(store, manifest, name)
                    return _point(store, manifest, first_epoch, steps_per_epoch)
            except CheckpointError:
                continue  # cut short (no manifest yet) or damaged: the one before it
    if resume is not None:
        return _point(stores["resume"], resume, first_epoch, steps_per_epoch)
    return None


def _point(store: Store, manifest: Manifest, first_epoch: int, steps_per_epoch: int) -> RollbackPoint:
    done: int = manifest["epochs_done"]
    local = done - first_epoch
    return local * steps_per_epoch - 1, load_params(store, manifest), local, done


# ------------------------------------------------------------------------------------------ the driver
def open_stores(
    checkpoint_dir: str | None, resume_from: str | None, spark_context: SparkContext | None, epochs_done: int = 0
) -> tuple[Stores, Manifest | None]:
    """The driver's stores by source ({"checkpoint": ..., "resume": ...}) and resume_from's manifest,
    every file of it checked; checkpoint_dir writable and holding no later checkpoints. All before any
    Spark job."""
    stores: Stores = {}
    resume = None
    if resume_from is not None:
        root = checkpoint_root(resume_from, "resume_from")
        try:
            store = stores["resume"] = driver_store(root, spark_context)
        except Exception as e:  # noqa: BLE001 - Hadoop's error (no FileSystem for the scheme, ...) via Py4J
            raise ValueError(f"resume_from={root!r} cannot be read: {error_line(e)}") from e
        resume = read_manifest(store, find(store), "resume")
    if checkpoint_dir is not None:
        try:
            store = stores["checkpoint"] = driver_store(checkpoint_dir, spark_context)
        except Exception as e:  # noqa: BLE001 - as above
            raise ValueError(f"checkpoint_dir={checkpoint_dir!r} is not writable: {error_line(e)}") from e
        check_writable(store)
        check_fresh(store, epochs_done if resume is None else resume["epochs_done"])
    return stores, resume


def start_service(stores: Stores, key: bytes, bind: str, timeout: float) -> CheckpointService | None:
    """The driver's checkpoint service (ckpt_service.py) when a store is not local, else None."""
    if all(isinstance(store, LocalStore) for store in stores.values()):
        return None
    return CheckpointService(stores, key, bind, timeout).start()


# ------------------------------------------------------------------------------------------ a fit's
def open_for_fit(
    checkpoint_dir: str | None, resume_from: str | None, sc: SparkContext | None, epochs_done: int = 0
) -> tuple[Stores, Manifest | None]:
    """The driver's checkpoint stores and resume_from's manifest, every file checked against it;
    ({}, None) without checkpoints. `epochs_done`: a re-formed elastic job's start (its epochs may be there)."""
    if resume_from is None and checkpoint_dir is None:
        return {}, None
    return open_stores(checkpoint_dir, resume_from, sc, epochs_done)


def plan_for_fit(
    checkpoint_dir: str | None, every: int, epochs: int, job: dict[str, Any], resume: Manifest | None
) -> tuple[CheckpointPlan | None, int, int]:
    """(CheckpointPlan or None, epochs done before this fit, epochs this fit runs) for a fit of `epochs`
    in all whose job (`job_of`) is `job`."""
    first = 0
    if resume is not None:
        check_job(resume, job)
        first = resume["epochs_done"]
        if first >= epochs:
            raise ValueError(
                f"resume_from={resume['directory']!r} has {first} epoch(s) done; epochs={epochs} "
                "leaves none to train (epochs counts from the start of the training)"
            )
    plan = None if checkpoint_dir is None else CheckpointPlan(checkpoint_dir, every, job)
    return plan, first, epochs - first


def relay_rollback(
    saving: CheckpointPlan | None,
    resume: Manifest | None,
    stores: Stores,
    first_epoch: int,
    steps_per_epoch: tuple[int, ...],
) -> Callable[[int], RollbackPoint | None] | None:
    """The relay's `rollback` (the relay core's observer, gradshare/task/tallies.py): with checkpoints, a retried stage
    restarts at the last one."""
    if saving is None and resume is None:
        return None
    return functools.partial(rollback_point, saving, resume, stores, first_epoch, steps_per_epoch[0])


def serve_checkpoints(
    stores: Stores,
    saving: CheckpointPlan | None,
    resume: Manifest | None,
    key: bytes,
    bind: str,
    host: str,
    timeout: float,
) -> tuple[CheckpointPlan | None, Manifest | None, CheckpointService | None]:
    """A Hadoop-FS checkpoint_dir or resume_from: start the driver's checkpoint service and tell the
    workers where it is; local ones need none. (plan, resume manifest, service or None)."""
    service: CheckpointService | None = start_service(stores, key, bind, timeout)
    if service is None:
        return saving, resume, None
    assert service.address is not None  # start_service started it
    address = (host, service.address[1])
    saving = None if saving is None else replace(saving, service=address)
    resume = None if resume is None else {**resume, "service": address}
    return saving, resume, service
