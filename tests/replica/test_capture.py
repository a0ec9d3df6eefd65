"""The direct update path (gradshare/replica/capture.py): which optimizers may write into the residual, and
that what they write there is their update, checked against NumPy oracles of SGD and Adam."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradshare.replica.capture import DirectPath, aliased, writes_update_only
from gradshare.replica.flat import FlatParams


def _params():
    return list(nn.Linear(3, 2).parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0),
        lambda p: torch.optim.AdamW(p, lr=1e-3),  # default weight_decay 1e-2, decoupled: taken out of the step
        lambda p: torch.optim.NAdam(p, lr=1e-3, weight_decay=1e-2, decoupled_weight_decay=True),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
        lambda p: torch.optim.Adagrad(p, lr=1e-2),
    ],
)
def test_optimizers_that_only_add_their_update_take_the_direct_path(make):
    assert writes_update_only(make(_params()))


class _MySGD(torch.optim.SGD):  # a subclass may read the parameter in its own step
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-4),  # L2 decay: λ·p enters the gradient
        lambda p: torch.optim.Adam([{"params": p[:1]}, {"params": p[1:], "weight_decay": 1e-3}], lr=1e-3),
        lambda p: _MySGD(p, lr=0.1),
        lambda p: torch.optim.LBFGS(p),
    ],
)
def test_optimizers_that_read_the_parameter_take_the_general_path(make):
    assert not writes_update_only(make(_params()))


def _flat(seed, shapes):
    rng = np.random.default_rng(seed)
    return FlatParams(
        nn.ParameterList([nn.Parameter(torch.from_numpy(rng.normal(size=s).astype(np.float32))) for s in shapes])
    )


def _direct_steps(flat, opt, grads_per_step):
    residual = np.zeros(flat.n_params, np.float32)
    before = flat.array.copy()
    for grads in grads_per_step:
        for p, g in zip(flat.params, grads):
            p.grad = torch.from_numpy(g.copy())
        with aliased(flat.params, flat.views(residual)):
            opt.step()
        assert np.array_equal(flat.array, before)  # P itself never moves
        assert all(p.data.data_ptr() == v.data_ptr() for p, v in zip(flat.params, flat.live))
    return residual


shapes = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple), min_size=1, max_size=4)


@settings(deadline=None, max_examples=30)
@given(shapes, st.integers(0, 2**31), st.floats(0.0, 0.95), st.integers(1, 4))
def test_sgd_momentum_writes_its_update_into_the_residual(shapes, seed, momentum, steps):
    flat = _flat(seed, shapes)
    lr = 0.05
    opt = torch.optim.SGD(flat.params, lr=lr, momentum=momentum)
    rng = np.random.default_rng(seed + 1)
    grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(steps)]
    residual = _direct_steps(flat, opt, grads)
    # oracle: torch's SGD in float64, buf_1 = g_1, buf_t = m buf_{t-1} + g_t, update -lr buf_t
    expect, buf = np.zeros(flat.n_params), None
    for gs in grads:
        g = np.concatenate([x.ravel() for x in gs]).astype(np.float64)
        buf = g if buf is None or momentum == 0 else momentum * buf + g
        expect -= lr * buf
    np.testing.assert_allclose(residual, expect, rtol=1e-5, atol=1e-6)


@settings(deadline=None, max_examples=30)
@given(shapes, st.integers(0, 2**31), st.integers(1, 4))
def test_adam_writes_its_update_into_the_residual(shapes, seed, steps):
    flat = _flat(seed, shapes)
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    opt = torch.optim.Adam(flat.params, lr=lr, betas=(b1, b2), eps=eps)
    rng = np.random.default_rng(seed + 1)
    grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(steps)]
    residual = _direct_steps(flat, opt, grads)
    m = v = np.zeros(flat.n_params)
    expect = np.zeros(flat.n_params)
    for t, gs in enumerate(grads, start=1):
        g = np.concatenate([x.ravel() for x in gs]).astype(np.float64)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        expect -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    np.testing.assert_allclose(residual, expect, rtol=1e-4, atol=1e-9)


@settings(deadline=None, max_examples=30)
@given(
    shapes,
    st.integers(0, 2**31),
    st.integers(1, 4),
    st.sampled_from([0.0, 1e-2, 0.3]),
    st.sampled_from(["single", "fused", "foreach"]),
)
def test_adamw_writes_its_update_and_its_decay_of_p_into_the_residual(shapes, seed, steps, decay, kind):
    """Decoupled decay on the direct path: the optimizer steps with λ = 0 and the path adds −lr·λ·P,
    P read from the replica (which the direct path never moves); the oracle is AdamW in float64."""
    flat = _flat(seed, shapes)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    opt = torch.optim.AdamW(
        flat.params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=decay, **({kind: True} if kind != "single" else {})
    )
    residual = np.zeros(flat.n_params, np.float32)
    path = DirectPath(flat, opt, residual)
    before = flat.array.copy()
    rng = np.random.default_rng(seed + 1)
    grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(steps)]
    for gs in grads:
        for p, g in zip(flat.params, gs):
            p.grad = torch.from_numpy(g.copy())
        assert path.optimizer_step()
        assert np.array_equal(flat.array, before)  # P never moves
        assert all(g["weight_decay"] == decay for g in opt.param_groups)  # λ put back after the step
    m = v = np.zeros(flat.n_params)
    expect, p64 = np.zeros(flat.n_params), before.astype(np.float64)
    for t, gs in enumerate(grads, start=1):
        g = np.concatenate([x.ravel() for x in gs]).astype(np.float64)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        expect -= lr * decay * p64 + lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    np.testing.assert_allclose(residual, expect, rtol=1e-4, atol=1e-7)


def test_decay_is_taken_per_group_and_only_for_parameters_the_step_took():
    flat = _flat(0, [(3, 2), (4,), (2,)])
    opt = torch.optim.AdamW(
        [{"params": flat.params[:1], "weight_decay": 0.5}, {"params": flat.params[1:], "weight_decay": 0.0}], lr=0.1
    )
    residual = np.zeros(flat.n_params, np.float32)
    path = DirectPath(flat, opt, residual)
    for p in flat.params[:2]:  # the last parameter has no gradient: AdamW skips it, and so does its decay
        p.grad = torch.zeros_like(p)
    assert path.optimizer_step()
    n0, n1 = flat.params[0].numel(), flat.params[1].numel()
    # a zero gradient: Adam's update is 0, only the first group's decay moves the residual
    np.testing.assert_allclose(residual[:n0], -0.1 * 0.5 * flat.array[:n0], rtol=1e-6)
    assert not residual[n0:].any()
    assert opt.param_groups[0]["weight_decay"] == 0.5 and n1 == 4


def test_an_update_below_the_weights_precision_still_reaches_the_residual():
    # Why the direct path is more than a speed-up: P_after - P_before loses an update below half an
    # ulp of its weight; written into the residual it accumulates until it crosses τ.
    module = nn.ParameterList([nn.Parameter(torch.full((4,), 1000.0))])
    flat = FlatParams(module)
    opt = torch.optim.SGD(flat.params, lr=1.0)
    residual = _direct_steps(flat, opt, [[np.full(4, 1e-6, np.float32)]] * 3)
    np.testing.assert_allclose(residual, -3e-6, rtol=1e-6)
    assert np.float32(1000.0) - np.float32(1e-6) == np.float32(1000.0)  # the general path would measure 0


def test_aliased_puts_the_parameters_back_when_the_step_raises():
    flat = _flat(0, [(2, 3), (3,)])
    other = np.zeros(flat.n_params, np.float32)
    with pytest.raises(RuntimeError, match="boom"):
        with aliased(flat.params, flat.views(other)):
            flat.params[0].data += 1.0
            raise RuntimeError("boom")
    assert all(p.data.data_ptr() == v.data_ptr() for p, v in zip(flat.params, flat.live))
    assert other[:6].tolist() == [1.0] * 6  # the write went where the alias pointed


def test_views_rejects_an_array_of_the_wrong_layout():
    flat = _flat(0, [(2, 3)])
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        flat.views(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="float32"):
        flat.views(np.zeros(6, np.float64))
