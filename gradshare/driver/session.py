"""Spark glue on the driver: session defaults, barrier slot checks, the pre-pass's summaries checked,
a DataFrame's columns as (features, label) rows.

Nothing here trains; it only gets data and slots ready for the barrier stage (docs/design.md, "Spark").
What runs in the tasks over each partition's rows is task/partition.py.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from pyspark import RDD, SparkContext
from pyspark.sql import DataFrame, SparkSession

from gradshare.task.partition import PartitionSummary, label_value

# The directory that holds the `gradshare` package the driver imported. Executors put it on their
# PYTHONPATH so that they run the same code as the driver (an editable install elsewhere, or none).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _executor_pythonpath() -> str:
    parts = [PACKAGE_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))  # dedupe, keep order


def session_builder(
    master: str, app_name: str = "gradshare", extra_conf: dict[str, str] | None = None
) -> SparkSession.Builder:
    """A SparkSession builder with gradshare's defaults for `master`.

    Local masters (``local[...]``, ``local-cluster[...]``) run Python workers with the driver's own
    interpreter (else executors may not find torch), stay on loopback and keep the UI off.
    """
    local = master.startswith("local")
    if local:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    conf = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.executorEnv.PYTHONPATH": _executor_pythonpath(),
    }
    if local:
        conf.update(
            {
                "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
                "spark.driver.memory": "1g",
                "spark.driver.host": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
                "spark.driver.bindAddress": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
            }
        )
    conf.update(extra_conf or {})
    for k, v in conf.items():
        builder = builder.config(k, v)
    return builder


def get_or_create_session(num_workers: int | None = None, master: str | None = None) -> tuple[SparkSession, bool]:
    """The active SparkSession, or an embedded ``local[N]`` one (N = num_workers, default 2).

    Returns ``(session, created)``; whoever created it stops it.
    """
    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        return active, False
    if master is None:
        n = num_workers or 2
        if n < 1:
            raise ValueError(f"num_workers must be >= 1, got {n}")
        master = f"local[{n}]"
    session = session_builder(master).getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session, True


def total_slots(sc: SparkContext) -> int:
    """How many tasks of the default resource profile can run at once (what barrier stages need)."""
    jsc = sc._jsc.sc()
    try:  # the scheduler's own count, the same one Spark's barrier check uses
        rp = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(rp))
    except Exception:  # noqa: BLE001 - private API moved: fall back to cores / task.cpus
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        return sc.defaultParallelism // max(cpus, 1)


def busy_slots(sc: SparkContext) -> int:
    tracker = sc.statusTracker()
    busy = 0
    for sid in tracker.getActiveStageIds():
        info = tracker.getStageInfo(sid)
        if info is not None:
            busy += info.numActiveTasks
    return busy


def check_barrier_slots(sc: SparkContext, needed: int, wait: float | None = None) -> None:
    """Raise a clear error when fewer than `needed` task slots are free for a barrier stage.

    Without this, Spark keeps re-checking for minutes before failing. Cluster masters get `wait`
    seconds (default 30; local: 0) for executors to register first.
    """
    if needed < 1:
        raise ValueError(f"a barrier stage needs at least 1 slot, got needed={needed}")
    master = str(sc.master)  # a running SparkContext's master is set
    if wait is None:
        wait = 0.0 if master.startswith("local[") or master == "local" else 30.0
    deadline = time.monotonic() + wait
    while True:
        total, busy = total_slots(sc), busy_slots(sc)
        if total - busy >= needed:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"not enough task slots for the barrier stage: {needed} workers need {needed} free slots, "
                f"but master {master!r} has {total} slots ({busy} busy, {max(total - busy, 0)} free); "
                f"use fewer partitions (num_workers) or more executor cores"
            )
        time.sleep(0.5)


def check_summaries(summaries: list[PartitionSummary]) -> PartitionSummary:
    """Raise the first partition's error, or a cross-partition mismatch; return the common layout
    (with partition 0's first row as the sample)."""
    summaries = sorted(summaries, key=lambda s: s.index)
    for s in summaries:
        if s.error is not None:
            raise (TypeError if s.error_type == "TypeError" else ValueError)(f"bad training data: {s.error}")
    first = summaries[0]
    for s in summaries[1:]:
        # only a summary with an error (raised above) lacks its layout (task/partition.summarise_partition)
        assert first.features is not None and s.features is not None
        assert first.label_shape is not None and s.label_shape is not None
        diff = first.features.difference(s.features)
        if diff is not None:  # each partition agrees with its own row 0, so row 0 is where it differs
            raise (ValueError if "shape" in diff[0] else TypeError)(
                f"bad training data: partition {s.index} has {diff[0]} {diff[1]}, partition {first.index} has "
                f"{diff[2]} (row 0 of each)"
            )
        if s.label_shape != first.label_shape or (s.label_kind != first.label_kind and s.label_shape != ()):
            raise TypeError(
                f"bad training data: partition {s.index} has labels {s.label_kind}{list(s.label_shape)}, "
                f"partition {first.index} has {first.label_kind}{list(first.label_shape)} (row 0 of each)"
            )
    kind = "float" if any(s.label_kind == "float" for s in summaries) else "int"
    ranges = [s.label_range for s in summaries if s.label_range is not None]
    span = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None
    return PartitionSummary(
        -1,
        sum(s.rows for s in summaries),
        first.features,
        kind,
        first.label_shape,
        labels_whole=all(s.labels_whole for s in summaries),
        sample=first.sample,
        label_range=span,
    )


def is_connect(data: object) -> bool:
    """A Spark Connect DataFrame or session: no SparkContext, no RDDs."""
    return type(data).__module__.startswith("pyspark.sql.connect")


def feature_columns(df: DataFrame, features_col: str | Iterable[str], label_col: str) -> list[str]:
    """features_col as a list of column names, every named column checked against the DataFrame's."""
    cols = [features_col] if isinstance(features_col, str) else list(features_col)
    if not cols or not all(isinstance(c, str) for c in cols):
        raise ValueError(f"features_col must be a column name or a non-empty list of them, got {features_col!r}")
    missing = [c for c in (*cols, label_col) if c not in df.columns]
    if missing:
        raise ValueError(f"DataFrame has no column(s) {missing}; its columns are {df.columns}")
    return cols


def dataframe_to_rdd(
    df: DataFrame, features_col: str | list[str] | tuple[str, ...], label_col: str
) -> RDD[tuple[Any, Any]]:
    """(features, label) rows from DataFrame columns (ML vectors, arrays or numbers; numeric labels).
    A list of feature columns gives multi-input rows ``((a, b, ...), label)``: model(a, b, ...)."""
    cols = feature_columns(df, features_col, label_col)
    selected = df.select(*cols, label_col).rdd
    if isinstance(features_col, str):
        return selected.map(tuple)
    # an array column arrives as a list, which `is_multi` counts as an input; a number column becomes
    # a 0-d array so that the tuple is still read as inputs (a (B,) tensor each)
    return selected.map(lambda r: (tuple(np.asarray(label_value(v)) for v in r[:-1]), r[-1]))
