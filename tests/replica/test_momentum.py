"""The workers' optimizer momentum lowered (gradshare/replica/momentum.py): a worker that steps its
optimizer with the momentum lowered for each step learns the same bits as one whose optimizer was built
with that momentum, on every update path; the optimizer (and a scheduler that cycles momentum) sees its
values as given; "off" or a number for an optimizer that has no momentum is refused, naming it."""

import pytest
import torch
from torch import nn

from gradshare.config import TrainConfig
from gradshare.config.options import Compression
from gradshare.driver.plan import check_optimizer
from gradshare.replica.momentum import check_optimizer_momentum, lower_momentum, momentum_ceiling, put_back
from one_worker import STEPS, run_one_worker

# (with momentum, the ceiling, the same optimizer built with the momentum at the ceiling)
PAIRS = {
    "adam-fused": (
        lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
        0.0,
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.0, 0.999), fused=True),
    ),
    "adam-half": (
        lambda p: torch.optim.Adam(p, lr=1e-2),
        0.5,
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.5, 0.999)),
    ),
    "adamw-decay": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2),
        0.0,
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.0, 0.99), weight_decay=1e-2),
    ),
    "nadam": (
        lambda p: torch.optim.NAdam(p, lr=1e-2),
        0.0,
        lambda p: torch.optim.NAdam(p, lr=1e-2, betas=(0.0, 0.999)),
    ),
    "sgd-nesterov": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        0.0,
        lambda p: torch.optim.SGD(p, lr=0.05),
    ),
    "sgd-nesterov-half": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        0.5,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, nesterov=True),
    ),
    "rmsprop": (
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
        0.0,
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
    ),
}


@pytest.mark.parametrize("in_backward", [True, False])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_lowered_momentum_learns_what_an_optimizer_built_with_it_learns(name, in_backward):
    given, ceiling, built = PAIRS[name]
    low, hashes_low, residual_low = run_one_worker(given, in_backward=in_backward, momentum_ceiling=ceiling)
    _, hashes_built, residual_built = run_one_worker(built, in_backward=in_backward)
    _, hashes_kept, _ = run_one_worker(given, in_backward=in_backward)
    assert hashes_low == hashes_built and (residual_low == residual_built).all()
    assert hashes_kept[1:] != hashes_low[1:]  # the momentum the ceiling lowers did change the steps
    assert len(set(hashes_low)) == STEPS
    as_given = given([nn.Parameter(torch.zeros(1))]).param_groups[0]
    for key in ("betas", "momentum", "nesterov", "lr"):  # the optimizer keeps its values as given
        assert low.optimizer.param_groups[0].get(key) == as_given.get(key)


def test_a_momentum_below_the_ceiling_is_left_as_it_is():
    sgd = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    adam = torch.optim.Adam([nn.Parameter(torch.ones(2))], lr=0.1, betas=(0.3, 0.99))
    assert lower_momentum(sgd, 0.5) == [] and lower_momentum(adam, 0.5) == []
    assert adam.param_groups[0]["betas"] == (0.3, 0.99)


def test_a_scheduler_that_cycles_momentum_is_overruled_for_the_step_only():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2, betas=(0.0, 0.999))
    sched_a = torch.optim.lr_scheduler.OneCycleLR(opt_a, max_lr=1e-2, total_steps=20, cycle_momentum=True)
    sched_b = torch.optim.lr_scheduler.OneCycleLR(opt_b, max_lr=1e-2, total_steps=20, cycle_momentum=False)
    x = torch.randn(32, 8)
    for _ in range(10):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
        saved = lower_momentum(opt_a, 0.0)
        opt_a.step()
        put_back(saved)
        opt_b.step()
        assert opt_a.param_groups[0]["betas"][0] > 0.8  # OneCycleLR's cycled β1, as it set it
        sched_a.step()
        sched_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_tensor_betas_stay_tensors():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    saved = lower_momentum(opt, 0.0)
    first, second = opt.param_groups[0]["betas"]
    assert isinstance(first, torch.Tensor) and float(first) == 0.0 and float(second) == pytest.approx(0.999)
    put_back(saved)
    assert float(opt.param_groups[0]["betas"][0]) == pytest.approx(0.9)


def test_an_optimizer_without_momentum_is_left_alone_and_refused_only_when_a_ceiling_is_asked():
    opt = torch.optim.Adagrad([nn.Parameter(torch.ones(2))], lr=0.1)
    assert lower_momentum(opt, 0.0) == []
    check_optimizer_momentum("auto", opt)
    check_optimizer_momentum("keep", opt)
    for asked in ("off", 0.5):
        with pytest.raises(ValueError, match=rf"optimizer_momentum={asked!r}: Adagrad has no momentum"):
            check_optimizer_momentum(asked, opt)
    with pytest.raises(ValueError, match="Adagrad"):  # the driver's check, before any Spark job
        check_optimizer(lambda p: torch.optim.Adagrad(p), None, nn.Linear(2, 2), "off")


def test_the_option_is_checked_and_a_given_value_is_the_ceiling():
    assert TrainConfig().compression.optimizer_momentum == "auto"  # by worker count: tests/driver/test_policy.py
    assert momentum_ceiling("off") == 0.0 and momentum_ceiling(0.5) == 0.5 and momentum_ceiling("keep") is None
    with pytest.raises(ValueError, match="the planner resolves it"):
        momentum_ceiling("auto")
    TrainConfig(compression=Compression(optimizer_momentum=0.0))
    for bad in ("none", 1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match=r"optimizer_momentum must be 'auto', 'off', 'keep' or a number in "):
            TrainConfig(compression=Compression(optimizer_momentum=bad))
