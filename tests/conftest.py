"""The ONE shared Spark session of the test suite (real local Spark, loopback, small), and the markers
that pick the fast subset.

Every test that needs Spark takes the session-scoped `spark` fixture; starting a JVM costs seconds, so
nobody starts their own (the single local-cluster test is the documented exception).
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SPARK_FIXTURES = frozenset({"spark", "digits_rdd", "connect", "on_a_cluster"})  # on_a_cluster: test_elastic.py
SOCKET_FOLDERS = (os.path.join(TESTS, "transport", "sockets") + os.sep,)


def pytest_collection_modifyitems(config, items):
    """`spark` on every test that takes a Spark fixture, `sockets` on every test in a sockets folder: the
    fast subset (-m "not spark and not sockets and not slow") cannot miss one by a forgotten mark."""
    for item in items:
        if SPARK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.spark)
        if str(item.path).startswith(SOCKET_FOLDERS):
            item.add_marker(pytest.mark.sockets)


@pytest.fixture(scope="session")
def spark():
    # Executors must run this interpreter (torch lives there) and import THIS tree's gradshare, and the lab
    # (benchmarks/lab/), whose functions tests/lab/ fits ship by reference.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    first = [ROOT, os.path.join(ROOT, "benchmarks")]
    paths = first + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)

    from gradshare.driver.session import session_builder

    session = session_builder(
        "local[2]",
        app_name="gradshare-tests",
        extra_conf={
            "spark.driver.memory": "768m",
            "spark.default.parallelism": "2",
            # One retry of a failed barrier stage is what the restart test needs; Spark's default of 4
            # attempts would only make the failure tests (user exception, unreachable relay) slower.
            "spark.stage.maxConsecutiveAttempts": "2",
        },
    ).getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits_rdd(spark):
    """scikit-learn's digits, training rows as a cached 2-partition RDD of (features, label), plus the
    test arrays: the end-to-end fits of several files share it."""
    from gradshare.demo import digits_split

    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    return spark.sparkContext.parallelize(rows, 2).cache(), (X_test, y_test)


@pytest.fixture(scope="session")
def connect(tmp_path_factory):
    """ONE local Spark Connect server for the test session, with a client session beside it, in a
    subprocess: a classic session (the `spark` fixture) and a Connect one cannot share a process
    (tests/connect_runner.py says why). Tests run their bodies there: ``connect.run("case", **kwargs)``."""
    from connect_runner import ConnectRunner

    runner = ConnectRunner(str(tmp_path_factory.mktemp("connect") / "runner.log"))
    yield runner
    runner.close()
