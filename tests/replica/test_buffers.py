"""BatchNorm and other float buffers (docs/guide/models.md): they live in the flat state after the
parameters, each step's change of them travels exactly in the step's update (encoding/update.py), and a
fit returns the buffers every replica holds bit for bit, scored by the validation metric of the model
`fit` returns."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle
from torch import nn

import naive
from gradshare import SharedTrainer
from gradshare.config.options import Network, Runtime
from gradshare.demo import digits_split, evaluate_accuracy, train_single_process
from gradshare.encoding import StepUpdate, apply_update, buffer_change, decode_entries, decode_update, encode
from gradshare.encoding.update import BUFFER_HEADER
from gradshare.errors import DecodeError
from gradshare.replica.flat import FlatParams
from gradshare.task.config import steps_per_epoch
from gradshare.transport import param_hash

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


def bn_mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


class BnCnn(nn.Module):
    """Digits as 8×8 images: two conv + BatchNorm2d blocks."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x):
        return self.body(x.view(-1, 1, 8, 8))


# ------------------------------------------------------------------------------------ the flat state
def test_flat_state_holds_float_buffers_after_the_parameters():
    torch.manual_seed(0)
    model = bn_mlp()
    with torch.no_grad():
        model[1].running_mean.uniform_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flat = FlatParams(model)
    assert flat.n_params == sum(p.numel() for p in model.parameters())
    assert flat.n_buffers == 2 * 128  # running_mean, running_var; num_batches_tracked is an int: local
    assert flat.buffer_names == ["1.running_mean", "1.running_var"]
    assert flat.state.shape == (flat.n_params + flat.n_buffers,)
    for k, v in model.state_dict().items():  # rebinding changed no value
        assert torch.equal(v, before[k]), k
    flat.buffer_array[:128] = 7.0  # the module's buffer IS the state's memory
    assert torch.all(model[1].running_mean == 7.0)
    model[1].running_var.fill_(3.0)
    assert np.all(flat.buffer_array[128:] == 3.0)
    values = np.arange(flat.n_state, dtype=np.float32)
    flat.load(values)
    assert np.array_equal(model[1].running_var.numpy(), values[-128:])
    with pytest.raises(ValueError, match=r"\(\d+ parameters \+ 256 buffer entries\)"):
        flat.load(values[: flat.n_params])


class Rebinds(nn.Module):
    """A module that replaces its buffer instead of updating it in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        self.seen = self.seen + x.mean(0)
        return self.lin(x)


def test_a_buffer_rebound_by_the_forward_pass_is_named():
    model = Rebinds()
    flat = FlatParams(model)
    flat.check_buffers()
    model(torch.ones(4, 3))
    with pytest.raises(TypeError, match="buffer 'seen' was rebound"):
        flat.check_buffers()


def test_half_precision_buffers_get_a_clear_error():
    model = nn.BatchNorm1d(4)
    model.running_mean.data = model.running_mean.data.half()
    with pytest.raises(TypeError, match="buffer 'running_mean' is torch.float16"):
        FlatParams(model)


# ------------------------------------------------------------------------------------ the update codec
@st.composite
def step_updates(draw):
    n_params = draw(st.integers(1, 300))
    n_buffers = draw(st.integers(0, 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tau = draw(st.sampled_from([1e-3, 0.5, 2.0]))
    msg = encode(np.zeros(n_params, np.float32), (rng.standard_normal(n_params) * 2).astype(np.float32), tau)
    before = rng.standard_normal(n_buffers).astype(np.float32)
    after = before.copy()
    moved = rng.random(n_buffers) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    after[moved] += rng.standard_normal(int(moved.sum())).astype(np.float32)
    world = draw(st.integers(1, 8))
    return StepUpdate(msg, *buffer_change(before, after, world)), n_params, n_buffers, before, after, world


@given(step_updates())
@SETTINGS
def test_step_update_round_trips_and_applies_like_the_oracle(case):
    update, n_params, n_buffers, before, after, world = case
    data = update.to_bytes(n_buffers)
    back = decode_update(data, n_params + n_buffers, n_params=n_params)
    assert back.message.to_bytes() == update.message.to_bytes()
    if n_buffers:
        assert np.array_equal(back.buffer_index, update.buffer_index)
        assert np.array_equal(back.buffer_value, update.buffer_value)
        changed = np.flatnonzero(after != before)
        assert np.array_equal(back.buffer_index, changed)  # every moved entry, nothing else
        assert np.allclose(back.buffer_value * world, (after - before)[changed], rtol=1e-6, atol=1e-7)
    else:
        assert data == update.message.to_bytes()  # a model without buffers sends the bare message
    state = np.random.default_rng(1).standard_normal(n_params + n_buffers).astype(np.float32)
    codes = np.asarray(decode_entries(back.message)[0]) * 2 + (decode_entries(back.message)[1] < 0)
    want = naive.apply_step_update(
        codes, back.message.threshold, back.buffer_index, back.buffer_value, state, n_params, scale=0.5
    )
    apply_update(back, state, scale=0.5)
    assert np.array_equal(state, want)


def _with_buffers(n_params=10, n_buffers=4, index=(1, 3), values=(0.5, -0.25)):
    msg = encode(np.zeros(n_params, np.float32), np.ones(n_params, np.float32), 0.5)
    head = msg.to_bytes()
    c = len(index)
    return head, head + BUFFER_HEADER.pack(b"GB", 1, 0, c) + struct.pack(f"<{c}I", *index) + struct.pack(
        f"<{c}f", *values
    )


@pytest.mark.parametrize(
    "tail, why",
    [
        (b"", "no room for its buffer section"),
        (BUFFER_HEADER.pack(b"XX", 1, 0, 0), "magic"),
        (BUFFER_HEADER.pack(b"GB", 9, 0, 0), "version 9"),
        (BUFFER_HEADER.pack(b"GB", 1, 0, 5), "5 entries, the model has 4"),
        (BUFFER_HEADER.pack(b"GB", 1, 0, 2) + struct.pack("<2I", 1, 3), "need 16"),
        (BUFFER_HEADER.pack(b"GB", 1, 0, 2) + struct.pack("<2I2f", 3, 1, 0, 0), "strictly increasing"),
        (BUFFER_HEADER.pack(b"GB", 1, 0, 2) + struct.pack("<2I2f", 1, 1, 0, 0), "strictly increasing"),
        (BUFFER_HEADER.pack(b"GB", 1, 0, 1) + struct.pack("<If", 4, 0), "< 4"),
        (BUFFER_HEADER.pack(b"GB", 1, 0, 1) + struct.pack("<If", 0, float("nan")), "non-finite"),
    ],
)
def test_bad_buffer_sections_are_decode_errors(tail, why):
    head, good = _with_buffers()
    assert len(decode_update(good, 14, n_params=10).buffer_index) == 2
    with pytest.raises(DecodeError, match=why):
        decode_update(head + tail, 14, n_params=10)


@given(st.binary(max_size=200), st.integers(0, 8))
@SETTINGS
def test_any_bytes_decode_or_raise_decode_error(data, n_buffers):
    try:
        update = decode_update(data, 16 + n_buffers, n_params=16)
    except DecodeError:
        return
    assert update.message.n_params == 16
    assert all(0 <= i < n_buffers for i in update.buffer_index)


def test_a_non_finite_running_statistic_is_named():
    with pytest.raises(ValueError, match=r"buffer entry 2 became nan .*\(from 0.0\)"):
        buffer_change(np.zeros(4, np.float32), np.array([0, 1, np.nan, 0], np.float32), 2)
    flat = FlatParams(bn_mlp())
    assert flat.buffer_entry_name(130) == "buffer '1.running_var' entry (2,)"


def test_drop_last_rules():
    assert steps_per_epoch(65, 32, "never") == 3
    assert steps_per_epoch(65, 32, "single") == 2
    assert steps_per_epoch(66, 32, "single") == 3
    assert steps_per_epoch(66, 32, "partial") == 2
    assert steps_per_epoch(64, 32, "partial") == 2


# ------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def digits(spark):
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    return spark.sparkContext.parallelize(rows, 2).cache(), X_train, y_train, X_test, y_test


@pytest.mark.spark
@pytest.mark.parametrize("factory, epochs", [(bn_mlp, 8), (BnCnn, 10)], ids=["mlp", "cnn"])
def test_batchnorm_models_match_the_single_process_in_eval_mode(digits, factory, epochs):
    rdd, X_train, y_train, X_test, y_test = digits
    r = SharedTrainer(factory, epochs=epochs, validation_data=(X_test, y_test), **LOOPBACK).fit(rdd)
    acc = evaluate_accuracy(r.model, X_test, y_test)  # eval mode: the running statistics decide
    single = evaluate_accuracy(
        train_single_process(factory, X_train, y_train, epochs=epochs, batch_size=32, seed=0), X_test, y_test
    )
    assert acc >= single - 0.015, (acc, single)
    assert r.history[-1]["val_metric"] == pytest.approx(acc, abs=1e-6)  # the score of the returned model
    bns = [m for m in r.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:  # the statistics were learnt, not left at their initial 0 / 1
        assert bn.running_mean.abs().max() > 1e-3 and (bn.running_var - 1).abs().max() > 1e-3
        assert bn.num_batches_tracked.item() == r.worker_reports[0]["last_step"] + 1
    # The hash every replica reported (fit raises on a mismatch) covers the buffers of the result.
    assert param_hash(FlatParams(r.model).state) == r.param_hash
    # Every worker downloaded the initial state (parameters and buffers) from the relay; that is the
    # model's distribution, counted apart from the training traffic.
    assert r.snapshot_bytes >= 4 * FlatParams(r.model).n_state * r.world_size
    assert r.bytes_received + r.snapshot_bytes == sum(rep["counters"]["bytes_in"] for rep in r.worker_reports)
    assert all(rep["param_hash"] == r.param_hash for rep in r.worker_reports)


@pytest.mark.spark
def test_a_one_row_final_batch_is_dropped_for_batchnorm(spark):
    X_train, _, y_train, _ = digits_split(0)
    rows = [(X_train[i], int(y_train[i])) for i in range(2 * 65)]  # 65 rows a partition: 2 × 32 + 1
    rdd = spark.sparkContext.parallelize(rows, 2)
    r = SharedTrainer(bn_mlp, epochs=1, **LOOPBACK).fit(rdd)
    assert [rep["last_step"] for rep in r.worker_reports] == [1, 1]  # 2 steps each: the 1-row batch dropped
    r = SharedTrainer(bn_mlp, epochs=1, batch_size=64, **LOOPBACK, runtime=Runtime(drop_last=False)).fit(
        spark.sparkContext.parallelize(rows[:128], 2)
    )
    assert r.steps == 1
    with pytest.raises(ValueError, match=r"partition 0 has 65 row\(s\): no batch of batch_size=100"):
        SharedTrainer(bn_mlp, epochs=1, batch_size=100, **LOOPBACK, runtime=Runtime(drop_last=True)).fit(rdd)
    with pytest.raises(ValueError, match="drop_last must be"):
        SharedTrainer(bn_mlp, runtime=Runtime(drop_last="sometimes"))
