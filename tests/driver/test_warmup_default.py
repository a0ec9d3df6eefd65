"""The default warm-up of threshold="auto": DEFAULT_WARMUP_EPOCHS epochs of the longest rank, but
never fewer than DEFAULT_WARMUP_MIN_STEPS steps; a warm-up the user gives is taken as given. Checked on the
rule each worker starts from, by the density it asks of each step (its public `target`)."""

import pytest
from torch import nn

from gradshare import SharedTrainer
from gradshare.config.options import DEFAULT_WARMUP_EPOCHS, DEFAULT_WARMUP_MIN_STEPS, Compression
from gradshare.driver.plan import rule_for
from gradshare.encoding import CalibratedThreshold
from lab.flat_options import in_groups

N_PARAMS = 10_000_000  # large enough that the 768-entry floor stays below the density


def ramp_length(rule) -> int:
    """Steps until the rule first asks for no more than its post-warm-up density."""
    final = rule.target(10**9, N_PARAMS)
    return next(t for t in range(10_000) if rule.target(t, N_PARAMS) <= final)


def model():
    return nn.Linear(4, 2)


def start_rule(steps_per_epoch: int, world: int = 2, **options):
    """The rule each of ``world`` workers of SharedTrainer(model, **options) starts from."""
    return rule_for(SharedTrainer(model, **in_groups(options)).config, steps_per_epoch, world)


@pytest.mark.parametrize("steps_per_epoch", [6, 12, 50])
def test_default_warmup_spans_its_epochs_but_at_least_the_floor(steps_per_epoch):
    rule = start_rule(steps_per_epoch)
    want = max(round(DEFAULT_WARMUP_EPOCHS * steps_per_epoch), DEFAULT_WARMUP_MIN_STEPS)
    assert ramp_length(rule) == want
    assert rule.target(0, N_PARAMS) > rule.target(want - 1, N_PARAMS) > rule.target(want, N_PARAMS)


def test_default_warmup_outlasts_two_epochs_and_the_floor_on_eleven_step_epochs():
    # the measured case (digits MLP, 2 workers, 11 steps an epoch): the floor's 24 steps (2 epochs gave 22)
    # reached 90 % one epoch after DDP
    assert ramp_length(start_rule(11)) > max(2 * 11, DEFAULT_WARMUP_MIN_STEPS)


def test_a_given_warmup_is_taken_as_given():
    assert ramp_length(start_rule(12, warmup=1)) == 12
    assert ramp_length(start_rule(12, warmup=0)) == 0


def test_the_workers_share_the_warmups_first_density():
    # every replica applies all N workers' messages: from 3 workers on they share 0.2 (8 workers start at
    # half the density of 4); one or two start at the single worker's cap
    from gradshare.encoding.threshold import DEFAULT_WARMUP_DENSITY

    first = {n: start_rule(12, n).target(0, N_PARAMS) for n in (1, 2, 3, 4, 8)}
    assert first[4] == pytest.approx(0.05) and first[8] == pytest.approx(first[4] / 2)
    assert first[3] == pytest.approx(0.2 / 3) and first[3] < first[2]
    assert DEFAULT_WARMUP_DENSITY == 0.07
    assert first[1] == first[2] == pytest.approx(DEFAULT_WARMUP_DENSITY)
    for n in (2, 4, 8):  # and every ramp still falls to the same density
        rule = start_rule(12, n)
        assert rule.target(10**6, N_PARAMS) < rule.target(0, N_PARAMS)


def test_a_given_warmup_density_is_taken_as_given_whatever_the_workers():
    for n in (2, 4, 8):
        assert start_rule(12, n, warmup_density=0.3).target(0, N_PARAMS) == pytest.approx(0.3)


def test_the_default_rule_decays_the_density_over_the_run_from_32_workers():
    from gradshare.encoding.threshold import DEFAULT_DECAY_FROM, DEFAULT_DECAY_LR_POWER, DEFAULT_DENSITY

    small, large = (start_rule(16, n, epochs=8, step_cap=None) for n in (16, 64))
    assert small.decay_from == 0.0 and small.lr_factor(0, N_PARAMS) == 1.0  # below 32 workers: as it was
    assert (large.decay_from, large.decay_lr_power, large.decay_steps) == (
        DEFAULT_DECAY_FROM,
        DEFAULT_DECAY_LR_POWER,
        8 * 16,
    )
    assert large.target(0, N_PARAMS) == pytest.approx(DEFAULT_DECAY_FROM)
    assert large.target(8 * 16, N_PARAMS) == pytest.approx(DEFAULT_DENSITY)
    assert large.lr_factor(0, N_PARAMS) == pytest.approx(
        (DEFAULT_DENSITY / DEFAULT_DECAY_FROM) ** DEFAULT_DECAY_LR_POWER
    )
    given = CalibratedThreshold(density=1e-3, decay_from=0.01)  # a user's rule: its decay spans the run too
    users = start_rule(10, 64, epochs=3, threshold_algorithm=given)
    assert (users.decay_from, users.decay_steps, given.decay_steps) == (0.01, 30, 0)
    off, on = (start_rule(10, n, epochs=2, decay_from=d, step_cap=None) for d, n in ((0.0, 64), (0.05, 4)))
    assert off.decay_from == 0.0 and off.lr_factor(0, N_PARAMS) == 1.0  # decay_from=0: off at any N
    assert (on.decay_from, on.decay_lr_power, on.decay_steps) == (0.05, DEFAULT_DECAY_LR_POWER, 20)
    with pytest.raises(ValueError, match="decay_from"):
        SharedTrainer(nn.Linear(4, 2), compression=Compression(decay_from=1.5))
    with pytest.raises(ValueError, match="decay_from"):
        SharedTrainer(
            nn.Linear(4, 2), threshold=1e-3, compression=Compression(decay_from=0.02)
        )  # it tunes threshold="auto"


def test_from_32_workers_the_default_caps_each_step_and_decays_the_density_at_the_full_lr():
    from gradshare.encoding.threshold import DEFAULT_DECAY_FROM

    capped = start_rule(16, 64, epochs=8)  # step_cap="auto": 0.1 from 32 workers on
    assert (capped.decay_from, capped.decay_lr_power) == (DEFAULT_DECAY_FROM, 0.0)
    assert capped.lr_factor(0, N_PARAMS) == 1.0
    assert start_rule(16, 64, epochs=8, step_cap=0.2).decay_lr_power == 0.0  # a given cap too
    assert start_rule(16, 4, step_cap=0.1, decay_from=0.05).decay_lr_power == 0.0


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "on", True])
def test_a_bad_step_cap_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="step_cap must be 'auto', None or a positive share"):
        SharedTrainer(nn.Linear(4, 2), compression=Compression(step_cap=bad))
