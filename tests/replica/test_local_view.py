"""The local view (gradshare/replica/local_view.py): a worker's forward/backward runs at P + s·r, while P stays
bit for bit what the log made it; checked against a reference model that holds P + s·r itself."""

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradshare import encoding
from gradshare.replica.flat import FlatParams
from gradshare.replica.local_view import LocalView
from gradshare.task.partition import PartitionData
from gradshare.task.worker import Worker
from gradshare.vectors import to_host
from worker_configs import worker_config


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _host(x) -> np.ndarray:
    return to_host(x).copy()


def _grads_at(model: nn.Module, point: np.ndarray, x, y) -> np.ndarray:
    """The gradient of the loss at parameters `point`, on a separate copy of the model (the oracle)."""
    ref = copy.deepcopy(model)
    flat = FlatParams(ref)
    flat.array[:] = point
    nn.functional.cross_entropy(ref(x), y).backward()
    return np.concatenate([p.grad.detach().numpy().ravel() for p in flat.params])


def _view(model, scale, tensors):
    # tensors: the device path's code on the CPU (P and the residual are torch tensors)
    flat = FlatParams(model, device=torch.device("cpu") if tensors else None)
    return flat, LocalView(flat, scale)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 0.5, 0.25]), tensors=st.booleans())
def test_the_gradient_is_taken_at_p_plus_the_scaled_residual_and_p_is_left_as_it_was(seed, scale, tensors):
    model = _model(seed)
    flat, view = _view(model, scale, tensors)
    rng = np.random.default_rng(seed)
    r_np = (rng.standard_normal(flat.n_params) * 0.1).astype(np.float32)
    residual = torch.from_numpy(r_np.copy()) if tensors else r_np.copy()
    x = torch.from_numpy(rng.standard_normal((8, 5)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, 8))
    p_before = _host(flat.array)
    with view.around(residual):
        nn.functional.cross_entropy(model(x), y).backward()
    assert _host(flat.array).tobytes() == p_before.tobytes()  # P moves only through the log
    assert _host(residual).tobytes() == r_np.tobytes()
    assert all(p.data.data_ptr() == v.data_ptr() for p, v in zip(flat.params, flat.views(flat.array)))
    got = np.concatenate([p.grad.detach().numpy().ravel() for p in flat.params])
    point = p_before + np.float32(scale) * r_np
    np.testing.assert_allclose(got, _grads_at(model, point, x, y), rtol=1e-5, atol=1e-6)
    if scale != 1.0:  # and not at P: the test would pass for a view that did nothing otherwise
        assert not np.allclose(got, _grads_at(model, p_before, x, y), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("tensors", [False, True], ids=["numpy", "tensor"])
def test_a_parameter_changed_in_place_in_the_forward_still_changes_p(tensors):
    # A user's bug that the fit's hash check must still see: the change lands in P, not only in the view.
    model = _model(0)
    flat, view = _view(model, 1.0, tensors)
    residual = torch.full((flat.n_params,), 0.25) if tensors else np.full(flat.n_params, 0.25, np.float32)
    before = _host(flat.array)
    with view.around(residual):
        with torch.no_grad():
            model[2].bias += 1.0
    bias = slice(flat.n_params - 3, flat.n_params)
    np.testing.assert_allclose(_host(flat.array)[bias], before[bias] + 1.0, rtol=1e-6)
    np.testing.assert_allclose(_host(flat.array)[: bias.start], before[: bias.start], atol=1e-6)


def test_a_body_that_raises_leaves_the_parameters_on_p():
    model = _model(1)
    flat = FlatParams(model)
    view = LocalView(flat)
    with pytest.raises(RuntimeError, match="boom"):
        with view.around(np.ones(flat.n_params, np.float32)):
            raise RuntimeError("boom")
    assert all(p.data.data_ptr() == v.data_ptr() for p, v in zip(flat.params, flat.views(flat.array)))


def _worker(local_view: bool) -> Worker:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=_model(2),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        threshold_rule=encoding.CalibratedThreshold(density=0.05, min_entries=0),
        residual_clip=None,
        steps_per_epoch=(math.ceil(64 / 16),),
        epochs=1,
        batch_size=16,
        staleness=0,
        seed=0,
        label_dtype="int64",
        local_view=local_view,
    )
    return Worker(cfg, 0, PartitionData(X, y))


class _Sink:
    def send_update(self, step, payload, meta=None):
        pass


def test_the_worker_steps_at_p_plus_its_residual_only_with_local_view():
    # Worker.step's gradient, seen by the optimizer, against the oracle at P + r and at P.
    for local_view in (True, False):
        w = _worker(local_view)
        sink, seen = _Sink(), []
        w.step(sink, 0)  # leaves a residual: 95 % of the first update stays unsent
        r = _host(w.state.residual_values())
        p = _host(w.flat.array)
        assert np.abs(r).max() > 0
        w.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: seen.append(np.concatenate([q.grad.numpy().ravel() for q in w.flat.params]))
        )
        w.step(sink, 1)
        batch = w.batches.read(0, 1)
        at_view, at_p = _grads_at(w.model, p + r, *batch), _grads_at(w.model, p, *batch)
        want, other = (at_view, at_p) if local_view else (at_p, at_view)
        np.testing.assert_allclose(seen[0], want, rtol=1e-5, atol=1e-7)
        assert not np.allclose(seen[0], other, rtol=1e-3, atol=1e-6)


def _lockstep(
    folded: bool, staleness: int, optimizer, scale: float = 1.0, steps: int = 12, direct: bool = True
) -> Worker:
    """One worker stepped against its own log (a one-rank SharedLog), with clipping and a calibrated τ:
    every pass that reads the residual runs."""
    from gradshare.task.apply_log import ApplyLog
    from gradshare.transport.testing.shared_log import LogPeer, SharedLog

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(128, 5)).astype(np.float32), rng.integers(0, 3, 128).astype(np.int64)
    cfg = worker_config(
        relay_address=("127.0.0.1", 1),
        key=bytes(32),
        job_id=1,
        world_size=1,
        model=_model(3),
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        threshold_rule=encoding.CalibratedThreshold(density=0.05, min_entries=0),
        residual_clip=encoding.ResidualClipping(clip=2.0, every=3),
        steps_per_epoch=(8,),
        epochs=2,
        batch_size=16,
        staleness=staleness,
        seed=0,
        label_dtype="int64",
        apply_scale=scale,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5, 0.5),
        folded_view=folded,
        direct_update=direct,
    )
    w, log = Worker(cfg, 0, PartitionData(X, y)), LogPeer(SharedLog(1), 0)
    w.log = ApplyLog(log, w.flat, 0, 10.0, scale=scale)
    for t in range(steps):
        w.log.apply_through(t - 1 - staleness)
        w.step(log, t)
    w.log.apply_through(steps - 1)
    return w


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_folded_view_learns_what_the_two_buffer_view_learns_up_to_rounding(staleness):
    # SGD's update is linear in the gradient, so a rounding-sized difference of the point stays that
    # size (Adam's first steps, lr·sign(g), would amplify it where g ~ 0); an lr schedule, clipping and
    # the lookahead (staleness 1) all run.
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    folded, two = _lockstep(True, staleness, sgd), _lockstep(False, staleness, sgd)
    assert folded.state.folded and folded.state.residual is None and folded.flat.point is not None
    assert not two.state.folded and isinstance(two.view, LocalView)  # the A/B really compared two forms
    p_f, p_t = folded.flat.array, two.flat.array
    assert np.abs(p_f - FlatParams(_model(3)).array).max() > 1e-2  # it trained
    np.testing.assert_allclose(p_f, p_t, rtol=0, atol=1e-6)
    np.testing.assert_allclose(folded.state.residual_values(), two.state.residual_values(), rtol=0, atol=1e-6)
    assert folded.state.tau == pytest.approx(two.state.tau, rel=1e-5)


@pytest.mark.parametrize("decay", [1e-2, 0.5])
def test_adamw_decay_on_the_folded_direct_path_learns_what_the_general_path_learns(decay):
    # Decoupled decay reads P, not the folded point: the direct path adds −lr·λ·P itself (capture.py),
    # so it keeps what the general path (the twin, the two-buffer view) learns, up to float32 rounding
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=decay)  # noqa: E731
    folded, general = _lockstep(True, 0, adamw), _lockstep(True, 0, adamw, direct=False)
    assert folded.state.folded and folded.path.name == "direct" and general.path.name == "general"
    np.testing.assert_allclose(folded.flat.array, general.flat.array, rtol=0, atol=1e-6)
    np.testing.assert_allclose(folded.state.residual_values(), general.state.residual_values(), rtol=0, atol=1e-6)
    no_decay = _lockstep(True, 0, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0)).flat.array
    assert np.abs(folded.flat.array - no_decay).max() > 20 * decay * 1e-4  # the decay was applied, not dropped


def test_the_two_buffer_view_stays_where_folding_would_change_what_is_learnt():
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    decay = lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-2)  # noqa: E731
    mean = _lockstep(True, 0, adam, scale=0.5, steps=1)  # aggregate="mean": the point must move by s·u
    general = _lockstep(True, 0, decay, steps=1)  # L2 decay reads the parameter: the general path
    for w in (mean, general):
        assert not w.state.folded and w.flat.point is None and isinstance(w.view, LocalView)
    assert _lockstep(True, 0, adam, steps=1).state.folded


def test_a_parameter_changed_in_place_under_the_folded_view_changes_p():
    # As with the two-buffer view: the replica leaves the log and the fit's hash check names it. The
    # changed parameter's point (its residual with it) becomes P; the others are untouched.
    from gradshare.replica.local_view import FoldedView

    model = _model(0)
    flat = FlatParams(model)
    point = flat.keep_point()
    point += np.float32(0.25)  # r = 0.25 everywhere
    before = flat.array.copy()
    view = FoldedView(flat, point)
    with view.around():
        with torch.no_grad():
            model[2].bias += 1.0
    bias = slice(flat.n_params - 3, flat.n_params)
    np.testing.assert_allclose(flat.array[bias], before[bias] + 1.25, rtol=1e-6)
    assert flat.array[: bias.start].tobytes() == before[: bias.start].tobytes()
    assert all(p.data.data_ptr() == v.data_ptr() for p, v in zip(flat.params, flat.views(flat.array)))
