"""A Spark standalone cluster on this machine's loopback, whose workers a benchmark or test starts and kills
while a fit runs (pyspark's own `spark-class` Master and Worker daemons; no download, no other address).

    with Cluster() as cluster:
        cluster.add_workers(4)                  # each one core, its own Worker JVM and executor JVM
        spark = cluster.session()                # the driver: a SparkSession on spark://127.0.0.1:<port>
        ...
        cluster.kill_worker(3)                   # the Worker daemon and its executor, SIGKILL: gone for good
        cluster.add_workers(1)                   # a new one: Spark gives the application an executor there
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pyspark

SPARK_HOME = os.path.dirname(pyspark.__file__)
START_TIMEOUT = 60.0  # s for the master's port and each worker's registration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A master and workers on 127.0.0.1, each a child process of this one, stopped on exit."""

    def __init__(self, worker_memory: str = "1g") -> None:
        self.port, self.ui = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.worker_memory = worker_memory
        self.env = {
            **os.environ,
            "SPARK_HOME": SPARK_HOME,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_MASTER_HOST": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_WORKER_DIR": os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gradshare-sw-{self.port}"),
        }
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.session_: Any = None

    def _spawn(self, cls: str, *args: str) -> subprocess.Popen[bytes]:
        cmd = [os.path.join(SPARK_HOME, "bin", "spark-class"), cls, *args]
        # a new process group: killing a worker kills its executor too (the executor is its child)
        return subprocess.Popen(
            cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def __enter__(self) -> Cluster:
        self.master = self._spawn(
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui),
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise TimeoutError(f"the standalone master did not listen on {self.port} in {START_TIMEOUT} s")
                time.sleep(0.3)

    def add_workers(self, n: int, cores: int = 1) -> None:
        for _ in range(n):
            self.workers.append(
                self._spawn(
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    str(cores),
                    "--memory",
                    self.worker_memory,
                    "--webui-port",
                    "0",
                    self.url,
                )
            )

    def session(self, executor_memory: str = "700m", **conf: str) -> Any:
        from pyspark.sql import SparkSession

        builder = (
            SparkSession.builder.master(self.url)
            .appName("gradshare-standalone")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.executor.memory", executor_memory)
            .config("spark.executor.cores", "1")
            .config("spark.ui.enabled", "false")
            .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        )
        for k, v in conf.items():
            builder = builder.config(k, v)
        self.session_ = builder.getOrCreate()
        self.session_.sparkContext.setLogLevel("ERROR")
        return self.session_

    def wait_slots(self, n: int, timeout: float = START_TIMEOUT) -> None:
        """Until the application has `n` executor cores (each worker's executor registered)."""
        from gradshare.driver.session import total_slots

        deadline = time.monotonic() + timeout
        while total_slots(self.session_.sparkContext) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} slots not registered within {timeout} s")
            time.sleep(0.3)

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker `index`'s daemon and its executor (its process group): the node is gone."""
        proc = self.workers[index]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def __exit__(self, *exc: object) -> None:
        if self.session_ is not None:
            try:
                self.session_.stop()
            except Exception:  # noqa: BLE001 - the cluster is going anyway
                pass
        for proc in [*self.workers, *([self.master] if self.master else [])]:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        shutil.rmtree(self.env["SPARK_WORKER_DIR"], ignore_errors=True)  # the executors' work directories
