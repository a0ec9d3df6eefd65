"""ONE local Spark Connect server for the test session, in a subprocess, and the tests' client inside it.

A classic session and a Connect ``remote("local[...]")`` session cannot share a Python process: the
builder refuses the second ([SESSION_ALREADY_EXIST]), and the suite's classic `spark` fixture lives for
the whole session. So the Connect tests run their bodies (tests/connect_cases.py) in one child process
that starts a local Connect server exactly as ``SparkSession.builder.remote("local[2]")`` does
(`_start_connect_server`: a classic SparkContext with the Connect plugin), on an ephemeral gRPC port so
that two suites on one machine do not clash, and holds a Connect client session to it. The test process
sends it (case name, kwargs) over an authenticated multiprocessing connection and gets back
("ok", value) or ("error", type name, message). Every wait has a timeout; `close` stops the session and
the process (SIGKILL after a grace period), so no JVM outlives the suite.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_SECONDS = 180  # a cold JVM plus the Connect server on a busy 2-core machine: ~15-30 s


class ConnectRunner:
    """The test side: starts the child, runs cases in it, stops it."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.authkey = os.urandom(16)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
            "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "GRADSHARE_CONNECT_AUTHKEY": self.authkey.hex(),
        }
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log
        )
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], START_SECONDS)
            line = self.proc.stdout.readline().decode() if ready else ""
            if not line.startswith("PORT "):
                raise RuntimeError(f"the Connect runner did not start: {line!r}; log {log_path}")
            self.conn = Client(("127.0.0.1", int(line.split()[1])), authkey=self.authkey)
            self.info = self._reply(START_SECONDS)  # the server is up
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the Connect runner did not answer within {timeout} s; log {self.log_path}")
        return self.conn.recv()

    def run(self, case: str, timeout: float = 240, **kwargs):
        """("ok", value) or ("error", type name, message) of connect_cases.<case>(spark, **kwargs)."""
        self.conn.send((case, kwargs))
        return self._reply(timeout)

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            try:
                conn.send(None)  # stop the session, then exit
            except OSError:
                pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve() -> None:
    """The child: listen, print the port, start the Connect server and a client session, run cases."""
    parent = os.getppid()

    def orphaned() -> None:  # the test process died without closing us: go (the JVM follows its stdin)
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(os.environ["GRADSHARE_CONNECT_AUTHKEY"]))
    print(f"PORT {listener.address[1]}", flush=True)
    os.dup2(2, 1)  # from here on stdout (Spark's, ours) goes to the log, never into the unread pipe
    conn = listener.accept()
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    import connect_cases

    port = _free_port()
    # what SparkSession.builder.remote("local[2]") does, on an ephemeral port
    ConnectSession._start_connect_server(
        "local[2]",
        {
            "spark.connect.grpc.binding.port": str(port),
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.memory": "768m",
            "spark.stage.maxConsecutiveAttempts": "2",
        },
    )
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    spark = ConnectSession.builder.remote(f"sc://localhost:{port}").getOrCreate()
    conn.send({"port": port, "session": type(spark).__module__})
    try:
        while conn.poll(3600):
            msg = conn.recv()
            if msg is None:
                break
            name, kwargs = msg
            try:
                reply = ("ok", getattr(connect_cases, name)(spark, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the test, which asserts on it
                traceback.print_exc()
                reply = ("error", type(e).__name__, str(e))
            conn.send(reply)
    finally:
        spark.stop()
        from pyspark import SparkContext

        gateway = SparkContext._gateway
        if SparkContext._active_spark_context is not None:  # the server's own context
            SparkContext._active_spark_context.stop()
        jvm = getattr(gateway, "proc", None)
        if jvm is not None:  # the JVM exits when its stdin closes; reap it here, not as init's zombie
            gateway.shutdown()
            jvm.stdin.close()
            try:
                jvm.wait(30)
            except subprocess.TimeoutExpired:
                jvm.kill()
                jvm.wait(10)


if __name__ == "__main__":
    serve()
