"""Mixed precision (gradshare/replica/precision.py): autocast forward, float32 master parameters, and
fp16's loss scaler, whose skipped steps send an empty message and leave the residual and P alone.

Unit tests drive the real Worker with an in-memory log (as test_staleness.py does); the fits run on the
shared Spark session with the digits MLP."""

import math
import sys

import numpy as np
import pytest
import torch
from pyspark import cloudpickle
from torch import nn

from gradshare import SharedTrainer, encoding
from gradshare.config.options import Network, Runtime
from gradshare.demo import digits_split, evaluate_accuracy, mlp
from gradshare.encoding import Message
from gradshare.replica.flat import FlatParams
from gradshare.replica.precision import Precision
from gradshare.task.apply_log import ApplyLog
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from gradshare.transport import Update, param_hash
from lab.flat_options import in_groups
from worker_configs import worker_config

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this module

LOOPBACK = dict(port=0, network=Network(bind="127.0.0.1"), verbose=0)


class _Peer:
    """One rank on an in-memory log: send_update records, receive hands back what it has not seen."""

    def __init__(self):
        self.messages, self.seen = [], set()

    def send_update(self, step, payload, meta=None):
        self.messages.append((step, 0, payload))

    def receive(self, until_step=None, timeout=None):
        new = sorted(m for m in self.messages if m[:2] not in self.seen)
        self.seen.update(m[:2] for m in new)
        return [Update(s, r, p, None) for s, r, p in new]


class _PoisonableLoss(nn.Module):
    """Cross entropy, times inf while `poison` is set: every gradient overflows, as fp16 ones can."""

    def __init__(self):
        super().__init__()
        self.poison = False

    def forward(self, out, y):
        loss = nn.functional.cross_entropy(out, y)
        return loss * math.inf if self.poison else loss


def _worker(precision, direct=True, staleness=0):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(128, 20)).astype(np.float32)
    y = (X[:, :5].sum(axis=1) > 0).astype(np.int64)
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2)),
        loss=_PoisonableLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        threshold_rule=encoding.CalibratedThreshold(),
        residual_clip=encoding.ResidualClipping(clip=5.0),
        steps_per_epoch=(4,),
        epochs=2,
        batch_size=32,
        staleness=staleness,
        seed=0,
        label_dtype="int64",
        precision=precision,
        direct_update=direct,
    )
    w = Worker(cfg, 0, PartitionData(X, y))
    assert w.path.name == ("direct" if direct else "general")
    peer = _Peer()
    w.log = ApplyLog(peer, w.flat, 0, 10.0)
    return w, peer


def _step(w, peer, t):
    w.log.apply_through(t - 1 - w.cfg.compression.staleness)
    w.step(peer, t)
    return Message.from_bytes(peer.messages[-1][2], max_params=w.flat.n_params)


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "general"])
def test_a_skipped_fp16_step_sends_an_empty_message_and_leaves_residual_and_parameters(direct, staleness):
    w, peer = _worker("fp16-mixed", direct, staleness)
    for t in range(3):
        assert _step(w, peer, t).n_entries > 0  # a calibrated τ sends something every real step
    w.log.apply_through(2 - staleness)  # what the next step starts from
    params, residual = w.flat.array.copy(), w.state.residual_values().copy()
    moments = [s["exp_avg"].clone() for s in w.optimizer.state.values()]
    scale = w.precision.scaler.get_scale()
    w.cfg.code.loss.poison = True
    msg = _step(w, peer, 3)
    assert msg.form == "empty" and msg.n_entries == 0  # sent all the same: the log advances past step 3
    assert [m[0] for m in peer.messages] == [0, 1, 2, 3]
    assert np.array_equal(w.state.residual_values(), residual)  # bit for bit: the optimizer never ran
    assert np.array_equal(w.flat.array, params)
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(w.optimizer.state.values(), moments))
    assert w.precision.scaler.get_scale() == scale / 2 and w.precision.skipped == 1
    w.cfg.code.loss.poison = False
    assert _step(w, peer, 4).n_entries > 0 and w.precision.skipped == 1  # and training goes on
    assert np.isfinite(w.state.residual_values()).all() and np.isfinite(w.flat.array).all()


def test_half_precision_forward_with_float32_parameters_and_updates():
    seen = {}
    for name in ("32", "bf16-mixed", "fp16-mixed"):
        w, peer = _worker(name)
        w.model[0].register_forward_hook(lambda m, i, out, name=name: seen.update({name: out.dtype}) or None)
        for t in range(4):
            _step(w, peer, t)
        w.log.apply_through(3)
        assert w.flat.array.dtype == np.float32 and all(p.dtype == torch.float32 for p in w.model.parameters())
        assert w.state.residual_values().dtype == np.float32 and w.precision.skipped == 0
        seen[name, "hash"] = param_hash(w.flat.array)
    assert (seen["32"], seen["bf16-mixed"], seen["fp16-mixed"]) == (torch.float32, torch.bfloat16, torch.float16)
    assert len({seen[n, "hash"] for n in ("32", "bf16-mixed", "fp16-mixed")}) == 3  # each computes its own way


@pytest.mark.parametrize("fused", [False, True])
def test_the_scaler_step_says_whether_the_optimizer_ran(fused):
    # A fused optimizer runs its step even on inf/NaN gradients and skips inside the kernel: the skip
    # is read from the scaler, so it is seen for both kinds.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    prec = Precision("fp16-mixed")
    x = torch.full((4, 3), 0.01)  # small: no real fp16 overflow at the initial scale 65536
    for poison, taken in ((False, True), (True, False), (False, True)):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with prec.autocast():
            loss = model(x).float().square().mean()
        prec.backward(loss * math.inf if poison else loss)
        assert prec.step(opt) is taken
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) is not taken
    assert prec.skipped == 1


def test_precision_is_checked_by_name():
    for bad in ("16", "bf16", "fp16", 32, None):
        with pytest.raises(ValueError, match=r"precision must be one of '32', 'bf16-mixed', 'fp16-mixed'"):
            SharedTrainer(mlp, runtime=Runtime(precision=bad))
    with pytest.raises(ValueError, match="precision"):
        Precision("64-true")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_are_refused_with_the_way_out(dtype):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(dtype)
    with pytest.raises(TypeError, match=rf"parameter '0.weight' is {dtype}.*model.float\(\).*precision='bf16-mixed'"):
        FlatParams(model)


# ------------------------------------------------------------------------------------ Spark fits
@pytest.fixture(scope="module")
def digits(spark):
    X_train, X_test, y_train, y_test = digits_split(0)
    rows = list(zip(X_train, (int(v) for v in y_train)))
    return spark.sparkContext.parallelize(rows, 2).cache(), (X_test, y_test)


def _fit(digits, **kw):
    rdd, (X_test, y_test) = digits
    result = SharedTrainer(mlp, batch_size=32, epochs=4, seed=3, **in_groups({**LOOPBACK, **kw})).fit(rdd)
    return result, evaluate_accuracy(result.model, X_test, y_test)


def test_bf16_and_fp16_mixed_fit_the_digits_as_well_as_float32(digits):
    full, acc32 = _fit(digits)
    assert acc32 > 0.85
    for name in ("bf16-mixed", "fp16-mixed"):
        result, acc = _fit(digits, precision=name)
        # fit() raises ConsistencyError unless every replica's hash equals the relay's
        assert all(rep["param_hash"] == result.param_hash for rep in result.worker_reports)
        assert result.param_hash != full.param_hash  # the autocast forward really ran
        assert abs(acc - acc32) <= 0.03, (name, acc, acc32)  # half-precision rounding, a few test rows
        assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]
        # the scaler may back off once or twice from its initial scale, not keep skipping
        assert all(rep["skipped_steps"] <= 2 for rep in result.worker_reports), result.worker_reports


def test_a_half_precision_model_is_refused_on_the_driver(digits):
    rdd, _ = digits
    with pytest.raises(TypeError, match=r"parameter '0.weight' is torch.bfloat16.*precision='bf16-mixed'"):
        SharedTrainer(lambda: mlp().to(torch.bfloat16), **LOOPBACK, runtime=Runtime(precision="bf16-mixed")).fit(rdd)


@pytest.mark.parametrize("fused", [False, True])
def test_gradient_clipping_sees_unscaled_gradients_under_fp16(fused):
    # A fused optimizer takes the loss scale into its kernel unless the scaler unscaled first: a
    # clipping pre-hook (losses.clip_grad_norm) would then clip gradients × 65536.
    from gradshare.replica.losses import clip_grad_norm

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    seen = []
    opt = clip_grad_norm(lambda p: torch.optim.Adam(p, lr=0.1, fused=fused), 1e6)(model.parameters())
    opt.register_step_pre_hook(
        lambda *_: seen.append(
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        )
    )
    x = torch.full((4, 3), 0.01)
    model(x).float().square().mean().backward()  # the gradient in float32, unscaled
    true_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    opt.zero_grad()
    prec = Precision("fp16-mixed")
    with prec.autocast():
        loss = model(x).float().square().mean()
    prec.backward(loss)
    assert prec.step(opt)
    assert seen[0] == pytest.approx(true_norm, rel=1e-2)  # not × the scale (65536)
