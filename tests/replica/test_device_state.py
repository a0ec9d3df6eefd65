"""The device code path run on the CPU: FlatParams with a torch tensor state, the buffer
change and its apply on tensors, and whole fits on the torch path (worker_options tensor_state) that end
bit-identical to the NumPy/Numba path. The codecs are bit-identical (tests/encoding/test_torch_codec.py), and every
other operation of a step is the same float32 operation on either kind (gradshare/vectors.py), so a
whole fit must be too. CUDA itself is not exercised here (no GPU on the test machines)."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer
from gradshare.config.options import Compression, Network, Runtime
from gradshare.demo import digits_split, mlp
from gradshare.encoding import StepUpdate, apply_update, buffer_change, encode
from gradshare.replica.flat import FlatParams
from gradshare.transport import param_hash

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)
CPU = torch.device("cpu")


def bn_mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


# ------------------------------------------------------------------------------------ FlatParams
def test_a_tensor_state_holds_the_same_values_and_the_module_aliases_it():
    torch.manual_seed(0)
    model = bn_mlp()
    with torch.no_grad():
        model[1].running_mean.uniform_()
    reference = FlatParams(copy.deepcopy(model))  # the NumPy state of the same model
    flat = FlatParams(model, device=CPU)
    assert isinstance(flat.state, torch.Tensor) and flat.device == CPU
    assert flat.state.dtype == torch.float32 and flat.state.shape == (flat.n_state,)
    assert np.array_equal(flat.host_state(), reference.state)  # the same layout and values as the NumPy state
    assert flat.array.data_ptr() == flat.state.data_ptr() and flat.array.numel() == flat.n_params
    assert flat.buffer_array.data_ptr() == flat.state.data_ptr() + 4 * flat.n_params
    flat.array[:5] = 2.5  # the module's parameters ARE the state's memory
    assert torch.all(model[0].weight.view(-1)[:5] == 2.5)
    model[1].running_var.fill_(3.0)  # and so are its float buffers
    assert torch.all(flat.buffer_array[32:] == 3.0)
    with torch.no_grad():
        model[3].bias.add_(1.0)
    assert torch.equal(flat.array[-10:], model[3].bias)


def test_load_twin_views_and_host_state_of_a_tensor_state():
    model = bn_mlp()
    flat = FlatParams(model, device=CPU)
    twin = flat.keep_twin()
    assert isinstance(twin, torch.Tensor) and torch.equal(twin, flat.array)
    assert twin.data_ptr() != flat.array.data_ptr()
    values = np.arange(flat.n_state, dtype=np.float32)
    flat.load(values)  # a host snapshot (the relay's) onto the device state, the twin following
    assert np.array_equal(flat.host_state(), values)
    assert np.array_equal(model[1].running_var.numpy(), values[-32:])
    assert torch.equal(twin, flat.array)
    flat.load(values.astype(np.float64))  # same_kind casting, as on the NumPy path
    with pytest.raises(ValueError, match=r"\(\d+ parameters \+ 64 buffer entries\)"):
        flat.load(values[:-1])
    residual = torch.zeros(flat.n_params)
    views = flat.views(residual)  # the direct path points the parameters at these (capture.py)
    views[0].fill_(1.0)
    assert residual[: model[0].weight.numel()].eq(1.0).all() and residual[model[0].weight.numel() :].eq(0).all()
    with pytest.raises(ValueError, match=r"contiguous float32 tensor of shape"):
        flat.views(torch.zeros(flat.n_params + 1))
    with pytest.raises(ValueError, match=r"C-contiguous float32 array"):
        FlatParams(bn_mlp()).views(np.zeros(3, np.float32))


def test_the_default_state_stays_numpy_and_a_device_model_is_refused_there():
    flat = FlatParams(mlp(16))
    assert isinstance(flat.state, np.ndarray) and flat.device is None and flat.host_state() is flat.state
    model = mlp(16).to("meta")  # any non-CPU device: the NumPy state needs host memory
    with pytest.raises(TypeError, match=r"on meta.*SharedTrainer\(runtime=Runtime\(device=\.\.\.\)\)"):
        FlatParams(model)


# ------------------------------------------------------------------------------------ buffers on tensors
@SETTINGS
@given(data=st.data(), n=st.integers(1, 300), world=st.integers(1, 7))
def test_buffer_change_and_its_apply_are_the_same_bits_on_tensors(data, n, world):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    before = (rng.normal(size=n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    moved = rng.random(n) < data.draw(st.floats(0.0, 1.0))
    after = np.where(moved, before * np.float32(0.9) + rng.normal(size=n).astype(np.float32), before)
    assert before.dtype == after.dtype == np.float32
    index, values = buffer_change(before, after, world)
    t_index, t_values = buffer_change(torch.from_numpy(before), torch.from_numpy(after), world)
    assert t_index.dtype == np.uint32 and t_values.dtype == np.float32
    assert np.array_equal(t_index, index) and np.array_equal(t_values.view(np.uint32), values.view(np.uint32))
    # ... and applied after a parameter message, into a state of 50 parameters then these buffers
    residual = rng.normal(size=50).astype(np.float32)
    update = StepUpdate(encode(residual, None, 0.5), index, values)
    state = np.concatenate([rng.normal(size=50).astype(np.float32), before])
    tensor = torch.from_numpy(state.copy())
    apply_update(update, state, 0.5)
    apply_update(update, tensor, 0.5)
    assert np.array_equal(tensor.numpy().view(np.uint32), state.view(np.uint32))


def test_a_non_finite_buffer_change_on_a_tensor_is_named():
    before = torch.zeros(4)
    after = torch.tensor([0.0, 1.0, float("inf"), 0.0])
    with pytest.raises(ValueError, match=r"buffer entry 2 became inf"):
        buffer_change(before, after, 2)


# ------------------------------------------------------------------------------------ whole fits
@pytest.fixture(scope="module")
def digits(spark):
    X_train, _, y_train, _ = digits_split(0)
    rows = list(zip(X_train[:640], (int(v) for v in y_train[:640])))
    return spark.sparkContext.parallelize(rows, 2).cache()


FITS = {
    "mlp": dict(model=lambda: mlp(32)),
    "batchnorm": dict(model=bn_mlp),
    "staleness-1": dict(model=lambda: mlp(32), compression=Compression(staleness=1)),
    "general-path": dict(model=bn_mlp, compression=Compression(staleness=1), worker_options={"direct_update": False}),
}


@pytest.mark.spark
@pytest.mark.parametrize("case", list(FITS))
def test_a_fit_on_the_tensor_path_is_bit_identical_to_the_numpy_path(digits, case):
    kw = dict(FITS[case])
    model, options = kw.pop("model"), kw.pop("worker_options", {})
    runtime = {
        tensor: Runtime(device="cpu", worker_options={**options, "tensor_state": tensor}) for tensor in (False, True)
    }
    fits = {
        tensor: SharedTrainer(model, epochs=2, **LOOPBACK, **kw, runtime=runtime[tensor]).fit(digits)
        for tensor in (False, True)
    }
    for tensor, r in fits.items():
        assert [rep["tensor_state"] for rep in r.worker_reports] == [tensor, tensor]
        assert [rep["device"] for rep in r.worker_reports] == ["cpu", "cpu"]
        assert all(rep["applied"] > 0 for rep in r.worker_reports)
    numpy_fit, tensor_fit = fits[False], fits[True]
    assert tensor_fit.param_hash == numpy_fit.param_hash
    assert [h["loss"] for h in tensor_fit.history] == [h["loss"] for h in numpy_fit.history]
    assert tensor_fit.worker_reports[0]["update_path"] == ("general" if "direct_update" in options else "direct")


def test_device_is_checked_on_the_driver():
    for bad in ("gpu", "cuda:x", "mps", 0, None):
        with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda', 'cuda:N', 'auto'"):
            SharedTrainer(mlp, runtime=Runtime(device=bad))
    assert SharedTrainer(mlp).runtime.device_name == "auto"
    # the driver needs no GPU to name one
    assert SharedTrainer(mlp, runtime=Runtime(device=" CUDA:1 ")).runtime.device_name == "cuda:1"
    assert SharedTrainer(mlp, runtime=Runtime(device=torch.device("cpu"))).runtime.device_name == "cpu"
    with pytest.raises(ValueError, match=r"worker_options\['tensor_state'\] must be True or False"):
        SharedTrainer(mlp, runtime=Runtime(worker_options={"tensor_state": "yes"}))


def _worker(device, **options):
    from gradshare import encoding
    from gradshare.task.partition import PartitionData
    from gradshare.task.worker import Worker
    from worker_configs import worker_config

    X, y = np.zeros((8, 64), np.float32), np.zeros(8, np.int64)
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=bn_mlp(),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        threshold_rule=encoding.CalibratedThreshold(),
        residual_clip=None,
        steps_per_epoch=(1,),
        epochs=1,
        batch_size=8,
        staleness=0,
        seed=0,
        label_dtype="int64",
        device=device,
        **options,
    )
    return Worker(cfg, 0, PartitionData(X, y))


def test_the_worker_resolves_its_device():
    if torch.cuda.is_available():  # a GPU machine: auto and cuda train there, on the torch state
        for device in ("auto", "cuda"):
            w = _worker(device)
            assert w.device.type == "cuda" and isinstance(w.flat.state, torch.Tensor)
            assert w.flat.state.device == w.device and w.state.target.device == w.device
        return
    w = _worker("auto")  # no GPU: the CPU, and the NumPy state CPU users had before
    assert w.device == CPU and isinstance(w.flat.state, np.ndarray) and isinstance(w.state.target, np.ndarray)
    w = _worker("cpu", tensor_state=True)
    assert isinstance(w.flat.state, torch.Tensor) and isinstance(w.state.target, torch.Tensor)
    assert w.path.views[0].data_ptr() == w.state.target.data_ptr()  # the direct path aliases the tensor it adds into
    with pytest.raises(ValueError, match=r"device 'cuda' was asked for, but torch cannot use CUDA here"):
        _worker("cuda")


def _benchmark(name: str):
    """A module of benchmarks/ (they import each other as scripts do, from their own folder)."""
    import importlib
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_the_device_step_benchmark_runs_both_paths_to_the_same_bits(tmp_path, capsys):
    import argparse
    import json

    device_step = _benchmark("device_step")
    parser = argparse.ArgumentParser()
    device_step.add_arguments(parser)
    out = tmp_path / "device_step.json"
    args = parser.parse_args(
        [
            "--widths",
            "64,48,10",
            "--steps",
            "4",
            "--warmup",
            "2",
            "--rounds",
            "2",
            "--threads",
            str(torch.get_num_threads()),
            "--json",
            str(out),
        ]
    )
    assert device_step.run(args) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["bit_identical"] is True and res["steps"] == 8
    assert "replicas bit-identical" in capsys.readouterr().out


@pytest.mark.parametrize(
    "precision, staleness, direct",
    [
        ("bf16-mixed", 0, True),
        ("fp16-mixed", 1, True),
        ("fp16-mixed", 1, False),
        ("32", 2, False),
    ],
)
def test_one_worker_steps_the_same_bits_on_either_state(precision, staleness, direct):
    """Autocast, the fp16 loss scaler and the lookahead (k >= 1, where one worker's own messages are all
    it waits for) on the torch state, step by step against the NumPy state, without Spark."""
    from gradshare import encoding
    from gradshare.task.apply_log import ApplyLog
    from gradshare.task.partition import PartitionData
    from gradshare.task.worker import Worker
    from gradshare.transport.testing.shared_log import LogPeer, SharedLog
    from worker_configs import worker_config

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(96, 64)).astype(np.float32), rng.integers(0, 10, 96).astype(np.int64)
    states = []
    for tensor in (False, True):
        torch.manual_seed(0)  # the same initial weights for both
        cfg = worker_config(
            relay_address=("127.0.0.1", 1),
            key=bytes(32),
            job_id=1,
            world_size=1,
            model=bn_mlp(),
            loss=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
            threshold_rule=encoding.CalibratedThreshold(),
            residual_clip=encoding.ResidualClipping(),
            steps_per_epoch=(3,),
            epochs=3,
            batch_size=32,
            staleness=staleness,
            seed=0,
            label_dtype="int64",
            precision=precision,
            device="cpu",
            tensor_state=tensor,
            direct_update=direct,
        )
        worker, log = Worker(cfg, 0, PartitionData(X, y)), LogPeer(SharedLog(1), 0)
        worker.log = ApplyLog(log, worker.flat, 0, 10.0)
        trail = []
        for t in range(9):
            worker.log.apply_through(t - 1 - staleness)
            worker.step(log, t)
            trail.append(param_hash(worker.flat.host_state()))
        if staleness:
            assert worker.state.pending  # own messages the log had not applied: the lookahead had work
        states.append(trail)
    assert states[0] == states[1]
