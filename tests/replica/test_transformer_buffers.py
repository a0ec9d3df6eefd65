"""Transformer models as users write them: which buffers are shared (persistent float buffers; a
constant one, -inf or NaN included, is never a change), sequence outputs (class-last logits) with the
default loss and metric, and the models and optimizers refused before Spark starts."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer
from gradshare.config.options import Compression, Network
from gradshare.encoding import buffer_change
from gradshare.encoding.torch_codec import buffer_change as buffer_change_tensor
from gradshare.errors import NonFiniteError
from gradshare.replica.flat import FlatParams, int_buffers
from gradshare.replica.losses import LossStep, accuracy, accuracy_sums, class_axis, plan_loss
from gradshare.transport import param_hash

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module
LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)
VOCAB, T, D = 16, 8, 16
DEVICE = torch.device(os.environ.get("GRADSHARE_TEST_DEVICE", "cpu"))  # as in test_torch_codec.py


class TinyCausalLM(nn.Module):
    """One attention block over token ids, with the buffers transformers keep: a causal -inf mask kept
    persistent and another one not (nn.Transformer's own), a rotary cos/sin cache rebuilt (rebound) in
    forward, int position ids, and a BatchNorm whose running statistics are shared."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.register_buffer("mask", torch.triu(torch.full((T, T), float("-inf")), diagonal=1))
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)
        self.register_buffer("position_ids", torch.arange(T))
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, VOCAB)

    def _rope(self, x):
        n = x.shape[1]
        if self.rope_cos.shape[:1] != (n,):  # rebuilt on first use, as rotary caches are
            angle = torch.arange(n)[:, None] / 100 ** (torch.arange(D // 2)[None] / (D // 2))
            self.rope_cos, self.rope_sin = angle.cos(), angle.sin()
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([a * self.rope_cos - b * self.rope_sin, a * self.rope_sin + b * self.rope_cos], -1)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.embed(ids) + self.pos(self.position_ids[:n])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = self._rope(q) @ self._rope(k).transpose(1, 2) / math.sqrt(D)
        scores = scores + self.mask[:n, :n] + self.causal[:n, :n]
        x = x + self.proj(scores.softmax(-1) @ v)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x)  # (B, T, VOCAB): class-last logits


def sequences(n, seed):
    """Arithmetic sequences mod VOCAB (a start and a stride of 1-3): the next token is determined from the
    second position on. Returns ids (n, T) and next-token labels (n, T), both int64."""
    rng = np.random.default_rng(seed)
    start, stride = rng.integers(0, VOCAB, (n, 1)), rng.integers(1, 4, (n, 1))
    seq = (start + stride * np.arange(T + 1)) % VOCAB
    return seq[:, :T].astype(np.int64), seq[:, 1:].astype(np.int64)


# ------------------------------------------------------------------------------------ which buffers
def test_only_persistent_float_buffers_are_state():
    model = TinyCausalLM()
    flat = FlatParams(model)
    assert flat.buffer_names == ["mask", "norm.running_mean", "norm.running_var"]
    assert flat.n_buffers == T * T + 2 * D
    assert np.isneginf(flat.buffer_array[1])  # the mask's entry (0, 1), held as is
    assert set(int_buffers(model)) == {"position_ids", "norm.num_batches_tracked"}
    model(torch.zeros(2, T, dtype=torch.int64))  # rebinds the rotary cache: not state, so no error
    flat.check_buffers()
    assert model.rope_cos.shape == (T, D // 2)


def _special(draw_float):
    return st.one_of(st.sampled_from([float("inf"), float("-inf"), float("nan"), 0.0, -0.0]), draw_float)


@st.composite
def buffer_steps(draw):
    """(before, after): buffers with ±inf/NaN/±0 entries, some of which a step moved to finite values."""
    n = draw(st.integers(1, 40))
    finite = st.floats(-1e3, 1e3, width=32)
    before = np.array(draw(st.lists(_special(finite), min_size=n, max_size=n)), np.float32)
    after = before.copy()
    for i in draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)):
        if np.isfinite(before[i]):
            after[i] = np.float32(draw(finite))
    return before, after


@given(buffer_steps(), st.integers(1, 8))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_buffer_entry_changes_when_its_bits_change(case, world):
    before, after = case
    index, values = buffer_change(before, after, world)
    want = [i for i in range(len(before)) if before[i].tobytes() != after[i].tobytes()]  # the naive oracle
    assert index.tolist() == want
    assert np.array_equal(values, ((after[want] - before[want]) / np.float32(world)).astype(np.float32))
    assert np.isfinite(values).all()
    on = (torch.from_numpy(before).to(DEVICE), torch.from_numpy(after).to(DEVICE))
    t_index, t_values = buffer_change_tensor(*on, world)
    assert t_index.tolist() == want and np.array_equal(t_values, values)  # the torch path: the same bits


def test_a_buffer_that_becomes_non_finite_is_named():
    with pytest.raises(ValueError, match=r"buffer entry 1 became inf .*\(from 0.0\)"):
        buffer_change(np.zeros(3, np.float32), np.array([0, np.inf, 0], np.float32), 2)
    with pytest.raises(ValueError, match=r"became 1.0 .*\(from -inf\)"):  # a constant that moved: inf change
        buffer_change(np.full(2, -np.inf, np.float32), np.array([-np.inf, 1], np.float32), 2)


# ------------------------------------------------------------------------------------ sequence outputs
def test_class_last_logits_take_the_default_loss_and_metric():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, T, VOCAB), torch.randint(0, VOCAB, (4, T))
    assert class_axis(logits, labels) == -1
    assert class_axis(logits.transpose(1, 2), labels) == 1
    step = LossStep(nn.CrossEntropyLoss(), classes=True)
    loss = step(lambda x: x, (logits, labels))
    assert torch.equal(loss, F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)))
    assert torch.equal(step(lambda x: x, (logits.transpose(1, 2), labels)), loss)  # PyTorch's layout: unchanged
    hits = float((logits.argmax(-1) == labels).sum())
    assert accuracy(logits, labels) == pytest.approx(hits / labels.numel())
    assert accuracy_sums(logits, labels) == (hits, float(labels.numel()))
    with pytest.raises(ValueError, match=r"could keep its classes on axis 1 or on the last axis; pass loss="):
        class_axis(torch.zeros(4, T, T), labels)  # (B, X, X) against (B, X): ambiguous
    with pytest.raises(ValueError, match=r"must be \(B, C, 8\) or \(B, 8, C\)"):
        class_axis(torch.zeros(4, 5, 7), labels)


def test_the_probe_plans_cross_entropy_for_a_language_model():
    ids, labels = sequences(1, 0)
    plan = plan_loss(TinyCausalLM(), ((ids[0],), labels[0]), "int", True)
    assert plan.name == "CrossEntropyLoss" and plan.label_dtype == "int64"
    assert plan.probe == f"output (B, {T}, {VOCAB})"
    with pytest.raises(ValueError, match=f"has {VOCAB} classes"):
        plan_loss(TinyCausalLM(), ((ids[0],), labels[0]), "int", True, label_range=(0, VOCAB))


# ------------------------------------------------------------------------------------ refused models
class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(VOCAB, 4, sparse=True)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, ids):
        return self.head(self.table(ids))


@pytest.mark.spark
def test_sparse_gradients_and_closure_optimizers_are_refused_before_spark_starts(spark):
    ids, labels = sequences(16, 0)
    rdd = spark.sparkContext.parallelize(list(zip(ids, labels)), 2)
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    with pytest.raises(ValueError, match=r"module 'table' is an embedding with sparse=True.*sparse=False"):
        SharedTrainer(SparseBag, **LOOPBACK).fit(rdd)
    with pytest.raises(ValueError, match="SparseAdam needs sparse gradients.*use Adam or AdamW"):
        SharedTrainer(TinyCausalLM, optimizer=lambda p: torch.optim.SparseAdam(p), **LOOPBACK).fit(rdd)
    with pytest.raises(ValueError, match=r"LBFGS.step needs a closure"):
        SharedTrainer(TinyCausalLM, optimizer=lambda p: torch.optim.LBFGS(p), **LOOPBACK).fit(rdd)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs  # no Spark job ran


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.spark
def test_a_causal_lm_with_mask_rotary_position_and_batchnorm_buffers_trains(spark):
    ids, labels = sequences(512, 0)
    rdd = spark.sparkContext.parallelize(list(zip(ids, labels)), 2)
    val_ids, val_labels = sequences(256, 1)
    torch.manual_seed(0)
    r = SharedTrainer(
        TinyCausalLM,
        epochs=6,
        batch_size=32,
        optimizer=lambda p: torch.optim.AdamW(p, 1e-2, weight_decay=0.01),
        validation_data=(val_ids, val_labels),
        **LOOPBACK,
        compression=Compression(staleness=1),
    ).fit(rdd)
    model = r.model.eval()
    assert r.extra["loss"] == "CrossEntropyLoss"
    with torch.no_grad():
        acc = accuracy(model(torch.from_numpy(val_ids)), torch.from_numpy(val_labels))
    assert acc > 0.6, acc  # from position 1 on the next token is determined; chance is 1/16
    assert r.history[-1]["val_metric"] == pytest.approx(acc, abs=1e-6)  # the returned model's score
    fresh = TinyCausalLM()
    assert torch.equal(model.mask, fresh.mask) and torch.equal(model.causal, fresh.causal)  # untouched -inf
    assert torch.equal(model.position_ids, torch.arange(T))
    assert model.norm.running_mean.abs().max() > 1e-3 and (model.norm.running_var - 1).abs().max() > 1e-3
    assert all(rep["param_hash"] == r.param_hash for rep in r.worker_reports)  # replicas bit-identical
    assert param_hash(FlatParams(model).state) == r.param_hash  # ... and the hash covers mask and BatchNorm


class Overflows(nn.Module):
    """A persistent float buffer that the forward pass really drives to +inf after a few steps."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(T, VOCAB)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, ids):
        if self.training:
            self.scale.mul_(1e30)  # 1 → 1e30 → inf on a replica's third step
        return self.lin(ids.float())


@pytest.mark.spark
def test_a_buffer_that_changes_to_inf_in_spark_names_the_buffer(spark):
    ids, labels = sequences(128, 0)
    rdd = spark.sparkContext.parallelize(list(zip(ids, labels[:, 0])), 2)
    with pytest.raises(Exception, match=r"buffer 'scale' entry \(0,\) became inf"):
        SharedTrainer(Overflows, epochs=1, batch_size=16, **LOOPBACK).fit(rdd)


# ------------------------------------------------------------------------------------ non-finite updates
def _one_worker(X, y, lr=1e-3):
    from gradshare.encoding import CalibratedThreshold
    from gradshare.task.apply_log import ApplyLog
    from gradshare.task.partition import PartitionData
    from gradshare.task.worker import Worker
    from gradshare.transport.testing.shared_log import LogPeer, SharedLog
    from worker_configs import worker_config

    model = nn.Sequential(nn.Linear(X.shape[1], 8), nn.ReLU(), nn.Linear(8, 3))
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr),
        threshold_rule=CalibratedThreshold(density=0.1),
        residual_clip=None,
        steps_per_epoch=(len(y) // 4,),
        epochs=1,
        batch_size=4,
        staleness=0,
        seed=0,
        label_dtype="int64",
    )
    worker = Worker(cfg, 0, PartitionData((X,), y))
    peer = LogPeer(SharedLog(1), 0)
    worker.log = ApplyLog(peer, worker.flat, 0, 10.0)
    return worker, peer


@pytest.mark.parametrize(
    "poison, cause",
    [
        ("input", r"input 0 of the batch hold NaN or inf \(batch rows \[\d\]\): clean the data"),
        ("lr", r"the loss is finite .* but the optimizer's update is not"),
    ],
)
def test_a_non_finite_update_names_rank_step_and_likely_cause(poison, cause):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((8, 5)).astype(np.float32), rng.integers(0, 3, 8)
    if poison == "input":
        X[5, 2] = np.nan  # in the second batch of 4 rows (their order is shuffled)
    worker, peer = _one_worker(X * 100, y, lr=3e38 if poison == "lr" else 1e-3)  # lr × gradient overflows float32
    # typed (a ValueError too): the worker tells it from other errors by its class, not its text
    with pytest.raises(
        NonFiniteError, match=r"rank 0, step \d \(epoch 0, batch \d\): the update is not finite: " + cause
    ):
        for t in range(2):
            worker.log.apply_through(t - 1)
            worker.step(peer, t)


def test_persistence_is_torchs_own_record_not_the_state_dict_keys():
    model = TinyCausalLM()
    # a state_dict hook that renames keys (as checkpoint-compatibility shims do) changes nothing here
    model._register_state_dict_hook(lambda module, sd, prefix, meta: {f"renamed.{k}": v for k, v in sd.items()})
    assert FlatParams(model).buffer_names == ["mask", "norm.running_mean", "norm.running_var"]


def test_the_decays_lr_factor_scales_one_optimizer_step_and_is_put_back():
    from gradshare.encoding import CalibratedThreshold
    from gradshare.task.apply_log import ApplyLog
    from gradshare.task.partition import PartitionData
    from gradshare.task.worker import Worker
    from gradshare.transport.testing.shared_log import LogPeer, SharedLog
    from worker_configs import worker_config

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((8, 5)).astype(np.float32), rng.integers(0, 3, 8)
    steps = []
    for power in (0.0, 1.0):
        torch.manual_seed(0)
        rule = CalibratedThreshold(density=0.05, decay_from=0.5, decay_steps=4, decay_lr_power=power)
        cfg = worker_config(
            relay_address=("127.0.0.1", 1),
            key=bytes(32),
            job_id=1,
            world_size=1,
            model=nn.Linear(5, 3),
            loss=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, 0.1),
            threshold_rule=rule,
            residual_clip=None,
            steps_per_epoch=(2,),
            epochs=1,
            batch_size=4,
            staleness=0,
            seed=0,
            label_dtype="int64",
            direct_update=False,
        )  # the general path: the update is P_after − P_before
        worker = Worker(cfg, 0, PartitionData((X,), y))
        peer = LogPeer(SharedLog(1), 0)
        worker.log = ApplyLog(peer, worker.flat, 0, 10.0)
        before = worker.flat.array.copy()
        worker.step(peer, 0)
        steps.append(worker.state.residual + worker.flat.array - before)  # sent + unsent: the whole update
        assert worker.optimizer.param_groups[0]["lr"] == 0.1  # put back after the step
    factor = CalibratedThreshold(density=0.05, decay_from=0.5, decay_steps=4, decay_lr_power=1.0).lr_factor(0, 18)
    assert factor == pytest.approx(0.1)
    np.testing.assert_allclose(steps[1], factor * steps[0], rtol=1e-3, atol=1e-7)  # P_after − P_before rounds
