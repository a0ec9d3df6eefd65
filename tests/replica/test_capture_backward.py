"""Stepping the optimizer in backward (gradshare/replica/capture.py; docs/benchmarks/memory.md): each parameter is
stepped from its gradient hook and its gradient dropped at once. The worker must learn exactly what it learns
with one optimizer step after backward (checked, not assumed, for every optimizer the direct path
takes), and fall back to that step when something needs every gradient at once."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradshare.config.options import Network, Runtime
from gradshare.replica.losses import clip_grad_norm
from one_worker import STEPS, mlp
from one_worker import run_one_worker as _run


class DetachedReuse(nn.Module):
    """`a` is used again, detached, nearer the input than its own gradient's node: that node's backward
    runs after `a` was stepped, and must not see `a` as modified (the step wrote into the residual)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(16, 16) / 4)
        self.b = nn.Parameter(torch.randn(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = x * self.b * self.a.detach().sum(0)  # saves a.detach() to give b its gradient
        return self.head(h @ self.a)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adam-foreach-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
    "adamw-decay": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw-decay-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stepping_in_backward_learns_the_same_bits(name):
    on, hashes_on, residual_on = _run(OPTIMIZERS[name])
    off, hashes_off, residual_off = _run(OPTIMIZERS[name], in_backward=False)
    assert on.path.in_backward and not off.path.in_backward
    assert hashes_on == hashes_off
    assert np.array_equal(residual_on, residual_off)
    assert len(set(hashes_on)) == STEPS  # the model moved every step: the comparison had something to see
    for p_on, p_off in zip(on.flat.params, off.flat.params):  # the optimizer's state too (moments, step)
        for key, value in off.optimizer.state[p_off].items():
            assert torch.equal(torch.as_tensor(on.optimizer.state[p_on][key]), torch.as_tensor(value)), key


def test_at_most_one_gradient_lives_during_backward_and_none_after_the_step():
    worker, _, _ = _run(OPTIMIZERS["adam-fused"], steps=1)
    live = []

    def count(_):  # registered after the worker's hook, so it runs after that hook stepped and dropped p
        live.append(sum(p.grad is not None for p in worker.flat.params))

    for p in worker.flat.params:
        p.register_post_accumulate_grad_hook(count)
    worker.step(worker.log.peer, 1)
    assert live == [0] * len(worker.flat.params)
    assert all(p.grad is None for p in worker.flat.params)


def test_a_parameter_reused_detached_nearer_the_input_still_trains_the_same():
    on, hashes_on, residual_on = _run(OPTIMIZERS["adam"], model=DetachedReuse)
    _, hashes_off, residual_off = _run(OPTIMIZERS["adam"], model=DetachedReuse, in_backward=False)
    assert on.path.in_backward
    assert hashes_on == hashes_off and np.array_equal(residual_on, residual_off)


def test_a_backward_the_worker_did_not_start_steps_nothing():
    worker, _, _ = _run(OPTIMIZERS["sgd"], steps=0)
    before = worker.state.residual_values().copy()
    worker.model(torch.ones(2, 16)).sum().backward()  # e.g. a user's own gradient check
    assert np.array_equal(worker.state.residual_values(), before)
    assert all(p.grad is not None for p in worker.flat.params)


@pytest.mark.parametrize("case", ["fp16-mixed", "clip_grad_norm", "global hook", "general path", "asked"])
def test_it_falls_back_to_one_step_after_backward_when_every_gradient_is_needed(case):
    make, options = OPTIMIZERS["adam"], {}
    if case == "fp16-mixed":  # the scaler unscales and checks inf/NaN over all gradients
        options["precision"] = "fp16-mixed"
    elif case == "clip_grad_norm":  # clips their total norm in a step pre-hook
        make = clip_grad_norm(make, 0.5)
    elif case == "general path":  # L2 decay reads P: the update is measured after the whole step
        make = lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-3)  # noqa: E731
    elif case == "asked":
        options["in_backward"] = False
    handle = register_optimizer_step_pre_hook(lambda *_: None) if case == "global hook" else None
    try:
        worker, hashes, _ = _run(make, **options)
    finally:
        if handle is not None:
            handle.remove()
    assert not worker.path.in_backward
    assert len(set(hashes)) == STEPS  # and it trains


def test_by_default_it_steps_in_backward_only_where_that_frees_enough_memory(monkeypatch):
    from gradshare.replica import capture

    small = sum(p.numel() * 4 for p in mlp().parameters())
    assert not _run(OPTIMIZERS["adam"], in_backward=None, steps=0)[0].path.in_backward
    monkeypatch.setattr(capture, "IN_BACKWARD_MIN_BYTES", small - 24 * 24 * 4)  # all but the largest (24 x 24)
    assert _run(OPTIMIZERS["adam"], in_backward=None, steps=0)[0].path.in_backward
    monkeypatch.setattr(capture, "IN_BACKWARD_MIN_BYTES", small - 24 * 24 * 4 + 1)
    assert not _run(OPTIMIZERS["adam"], in_backward=None, steps=0)[0].path.in_backward


@pytest.mark.parametrize(
    "precision, staleness, tensor_state", [("bf16-mixed", 0, False), ("32", 1, False), ("32", 1, True)]
)
def test_autocast_the_lookahead_and_the_device_state_step_in_backward_to_the_same_bits(
    precision, staleness, tensor_state
):
    """bf16 autocast; staleness 1, where each step runs at P + this rank's own unapplied messages; the
    torch state and residual a GPU uses, here on the CPU."""
    kw = dict(precision=precision, staleness=staleness, tensor_state=tensor_state)
    on, hashes_on, residual_on = _run(OPTIMIZERS["adam-fused"], **kw)
    _, hashes_off, residual_off = _run(OPTIMIZERS["adam-fused"], in_backward=False, **kw)
    assert on.path.in_backward and hashes_on == hashes_off and np.array_equal(residual_on, residual_off)
    assert not staleness or on.state.pending  # the lookahead had own messages to step at


@pytest.mark.spark
def test_a_two_worker_fit_steps_in_backward_to_the_same_model(spark):
    """Through the relay, 2 workers, the default fused Adam: forced on and off, the same parameters."""
    from gradshare import SharedTrainer
    from gradshare.demo import digits_split

    X, _, y, _ = digits_split(0)
    rdd = spark.sparkContext.parallelize(list(zip(X[:256], (int(v) for v in y[:256]))), 2).cache()
    fits = {}
    for on in (True, False):
        model = lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))  # noqa: E731
        fits[on] = SharedTrainer(
            model,
            batch_size=32,
            epochs=1,
            seed=5,
            port=0,
            verbose=0,
            network=Network(bind="127.0.0.1"),
            runtime=Runtime(worker_options={"step_in_backward": on}),
        ).fit(rdd)
        assert [r["step_in_backward"] for r in fits[on].worker_reports] == [on, on]
    assert fits[True].param_hash == fits[False].param_hash
