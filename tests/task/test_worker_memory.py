"""What keeps a worker's baseline and peak small (benchmarks/worker_memory.py, docs/benchmarks/memory.md): freed heap
pages go back to the OS after big transients, and loading the kernels does not load scipy.linalg."""

import os
import subprocess
import sys

from gradshare.task.memory import proc_status_bytes, release_free_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_release_free_memory_returns_freed_heap_pages():
    # 64 kB blocks are below glibc's mmap threshold: they come from the heap, and a block allocated
    # after them pins the heap's top, so free() alone gives none of their pages back
    blocks = [bytearray(64 << 10) for _ in range(800)]  # 50 MiB, written (zero-filled)
    pin = bytearray(64 << 10)
    del blocks
    held = proc_status_bytes("VmRSS")
    release_free_memory()
    assert held - proc_status_bytes("VmRSS") > 30 << 20
    del pin


def test_the_kernels_load_without_scipy_linalg():
    """Numba's first kernel load imports numba.np.arraymath, whose BLAS probe would import scipy.linalg
    (~15 MB per worker); gradshare's kernels import that module without it (encoding/kernels.py)."""
    code = (
        "import sys, numpy as np; from gradshare import encoding; "
        "r = np.zeros(4096, np.float32); m = encoding.encode(r, np.ones(4096, np.float32), 0.5); "
        "encoding.apply(m, np.zeros(4096, np.float32)); "
        "print(m.n_entries, 'scipy.linalg' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4096", "False"]


def test_a_worker_imports_neither_pandas_nor_pyarrow():
    """The task's module tree (task/: train, worker, partition, validation; replica/: losses, ...) and the driver's
    Spark glue it used to share a module with stay off pyspark.ml, whose package
    __init__ imports pandas and pyarrow: ~50 MB more in every worker's baseline for nothing it runs."""
    code = (
        "import sys, gradshare.task.train, gradshare.task.partition, gradshare.task.validation, "
        "gradshare.driver.session, gradshare.driver.validation; "
        "print(*[m in sys.modules for m in ('pandas', 'pyarrow', 'pyspark.ml')])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]
