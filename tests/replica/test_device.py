"""resolve_device: "cpu" | "cuda" | "cuda:N" | "auto" | torch.device, with the Spark task context and the
CUDA device count injected (fakes), and once inside a real Spark task."""

from __future__ import annotations

import pytest
import torch

from gradshare.replica.device import resolve_device, task_gpu


class FakeResource:
    def __init__(self, addresses):
        self.name, self.addresses = "gpu", addresses


class FakeTaskContext:
    """What resolve_device reads of pyspark's TaskContext: resources() -> {name: ResourceInformation}."""

    def __init__(self, resources):
        self._resources = resources

    def resources(self):
        return self._resources


def _gpus(*addresses):
    return FakeTaskContext({"gpu": FakeResource(list(addresses))})


@pytest.mark.parametrize("device", ["cpu", "CPU", " cpu ", torch.device("cpu")])
def test_cpu_is_always_available(device):
    assert resolve_device(device, cuda_count=0) == torch.device("cpu")


def test_cuda_names_resolve_when_torch_sees_enough_devices():
    assert resolve_device("cuda", cuda_count=1) == torch.device("cuda")
    assert resolve_device("cuda:3", cuda_count=4) == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda", 1), cuda_count=2) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("device", "count", "match"),
    [
        ("cuda", 0, r"device 'cuda' was asked for, but torch cannot use CUDA"),
        ("cuda:1", 0, r"device 'cuda:1' was asked for, but torch cannot use CUDA"),
        ("cuda:2", 2, r"device 'cuda:2' was asked for, but torch sees only 2 CUDA device\(s\): cuda:0..cuda:1"),
    ],
)
def test_an_unusable_cuda_device_is_a_clear_error(device, count, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(device, cuda_count=count)


def test_cuda_without_a_gpu_here_is_an_error_with_the_real_count():
    # The real torch of this process: a CPU build or no GPU gives the error, a GPU machine the device.
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ValueError, match="device 'cuda' was asked for"):
            resolve_device("cuda")


@pytest.mark.parametrize(
    ("device", "exc", "match"),
    [
        ("tpu", ValueError, "device must be 'cpu', 'cuda', 'cuda:N', 'auto'"),
        ("cuda:x", ValueError, "device must be"),
        ("meta", ValueError, "device 'meta' is not supported"),
        (0, TypeError, "device must be a str or torch.device, got int"),
    ],
)
def test_bad_device_names(device, exc, match):
    with pytest.raises(exc, match=match):
        resolve_device(device, cuda_count=1)


def test_auto_takes_the_gpu_spark_assigned_to_the_task():
    assert resolve_device("auto", task_context=_gpus("1"), cuda_count=2) == torch.device("cuda", 1)
    assert resolve_device("auto", task_context=_gpus("3", "2"), cuda_count=4) == torch.device("cuda", 3)


def test_auto_with_an_assigned_gpu_torch_cannot_use_is_an_error():
    with pytest.raises(ValueError, match="Spark assigned GPU 1 to this task, but torch cannot use CUDA"):
        resolve_device("auto", task_context=_gpus("1"), cuda_count=0)
    with pytest.raises(ValueError, match="Spark assigned GPU 5 to this task, but torch sees only 2"):
        resolve_device("auto", task_context=_gpus("5"), cuda_count=2)
    with pytest.raises(ValueError, match="GPU address 'GPU-8f2c' is not a CUDA ordinal"):
        resolve_device("auto", task_context=_gpus("GPU-8f2c"), cuda_count=2)


@pytest.mark.parametrize(
    "context", [None, FakeTaskContext({}), FakeTaskContext({"fpga": FakeResource(["0"])}), _gpus()]
)
def test_auto_without_a_task_gpu_takes_cuda_if_any_else_the_cpu(context):
    assert resolve_device("auto", task_context=context, cuda_count=0) == torch.device("cpu")
    assert resolve_device("auto", task_context=context, cuda_count=2) == torch.device("cuda")
    assert task_gpu(context) is None


def test_auto_on_the_driver_asks_pyspark_and_finds_no_task():
    # Outside a task TaskContext.get() is None: the choice falls to CUDA's presence.
    assert resolve_device("auto", cuda_count=0) == torch.device("cpu")


def test_the_real_spark_task_context_has_no_gpu_here(spark):
    # What "auto" reads inside a real task (pyspark's TaskContext.resources()) without GPU scheduling:
    # no address, so the choice falls to CUDA's presence. (torch is not imported: it keeps this fast.)
    def probe(_):
        from pyspark import TaskContext

        from gradshare.replica.device import task_gpu

        context = TaskContext.get()
        yield (context is not None, task_gpu(context))

    assert spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect() == [(True, None)]


def test_select_gives_cuda_its_index_without_asking_set_device_for_an_unindexed_device(monkeypatch):
    # found on an H200 (torch 2.11): torch.cuda.set_device(torch.device("cuda")) raises "Expected a
    # torch.device with a specified index", so device="cuda" failed every worker; here torch's CUDA calls
    # are stood in for, as a CPU machine has none
    from gradshare.replica.device import select

    calls = []

    def set_device(dev):
        if isinstance(dev, torch.device) and dev.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{dev}")
        calls.append(dev)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert select(torch.device("cuda")) == torch.device("cuda", 2) and calls == []
    assert select(torch.device("cuda", 1)) == torch.device("cuda", 1) and calls == [torch.device("cuda", 1)]
    assert select(torch.device("cpu")) == torch.device("cpu") and len(calls) == 1
