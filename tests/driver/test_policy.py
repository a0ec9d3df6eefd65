"""The planner's table (driver/policy.py): what every "auto" option is at each worker count, as `fit` and
the lock-step harness both get it from `plan_steps`."""

import pytest

from gradshare.config import TrainConfig
from gradshare.config.options import Compression
from gradshare.driver.plan import forwarding_for, plan_steps
from gradshare.driver.policy import AGGREGATE_FROM, MANY_WORKERS, auto_for
from gradshare.encoding import CalibratedThreshold


def test_the_table_row_by_row():
    rows = {n: auto_for(n) for n in (1, 2, 4, 15, 16, 31, 32, 64, 256)}
    assert [rows[n].momentum for n in rows] == [0.5] * 6 + [0.0] * 3
    assert [rows[n].step_cap for n in rows] == [0.06] * 6 + [0.1] * 3
    assert [rows[n].decay_from for n in rows] == [0.0] * 6 + [0.02] * 3
    assert [rows[n].forwarding for n in rows] == ["per-rank"] * 4 + ["aggregate"] * 5
    assert [rows[n].warmup_density for n in (1, 2, 4, 64)] == [0.07, 0.07, 0.05, 0.2 / 64]
    assert (AGGREGATE_FROM, MANY_WORKERS) == (16, 32)


@pytest.mark.parametrize("world", [2, 4, 16, 32, 64])
def test_the_planner_reads_auto_from_the_table_and_takes_given_options_as_given(world):
    row = auto_for(world)
    plan = plan_steps(TrainConfig(epochs=3), world, 100)
    assert (plan.momentum_ceiling, plan.cap_share, plan.apply_scale, plan.lr_factor) == (
        row.momentum,
        row.step_cap,
        1.0,
        1.0,
    )
    rule = plan.rule
    assert isinstance(rule, CalibratedThreshold)
    # the cap takes the decay's lower lr's place
    assert (rule.decay_from, rule.decay_lr_power, rule.warmup_density) == (row.decay_from, 0.0, row.warmup_density)
    given = plan_steps(
        TrainConfig(epochs=3, compression=Compression(optimizer_momentum="keep", step_cap=None, aggregate="mean")),
        world,
        100,
    )
    assert (given.momentum_ceiling, given.cap_share, given.apply_scale) == (None, None, 1.0 / world)
    uncapped = plan_steps(TrainConfig(epochs=3, compression=Compression(step_cap=None)), world, 100).rule
    assert isinstance(uncapped, CalibratedThreshold) and uncapped.decay_lr_power == (0.35 if world >= 32 else 0.0)
    assert (
        forwarding_for("auto", world) == row.forwarding
        and forwarding_for("auto", world, checkpointed=True) == "per-rank"
    )
