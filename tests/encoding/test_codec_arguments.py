"""Bad arguments to encode/apply raise clear errors; NaN/inf behaviour is as documented in codec.py."""

from __future__ import annotations

import numpy as np
import pytest

from gradshare.encoding import Message, apply, encode


def _vec(n=16, value=0.0):
    return np.full(n, value, np.float32)


@pytest.mark.parametrize(
    ("residual", "update", "exc", "match"),
    [
        (np.zeros(4, np.float64), None, TypeError, "residual must have dtype float32"),
        ([0.0, 1.0], None, TypeError, "residual must be a numpy.ndarray"),
        (np.zeros((2, 2), np.float32), None, ValueError, "residual must be 1-D"),
        (np.zeros(8, np.float32)[::2], None, ValueError, "residual must be C-contiguous"),
        (_vec(4), np.zeros(5, np.float32), ValueError, "update has 5 elements, expected 4"),
        (_vec(4), np.zeros(4, np.float16), TypeError, "update must have dtype float32"),
        (_vec(4), np.zeros(8, np.float32)[::2], ValueError, "update must be C-contiguous"),
    ],
)
def test_encode_rejects_bad_arrays(residual, update, exc, match):
    with pytest.raises(exc, match=match):
        encode(residual, update, 1.0)


def test_encode_rejects_bad_base():
    with pytest.raises(ValueError, match="base needs an update"):
        encode(_vec(4), None, 1.0, base=_vec(4))
    with pytest.raises(ValueError, match="base has 5 elements, expected 4"):
        encode(_vec(4), _vec(4), 1.0, base=_vec(5))
    with pytest.raises(TypeError, match="base must have dtype float32"):
        encode(_vec(4), _vec(4), 1.0, base=np.zeros(4))
    with pytest.raises(ValueError, match="rewind needs a base"):
        encode(_vec(4), _vec(4), 1.0, rewind=True)
    both = _vec(8)
    with pytest.raises(ValueError, match="must not overlap"):
        encode(_vec(4), both[:4], 1.0, base=both[2:6], rewind=True)
    frozen = _vec(4)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="update must be writable"):
        encode(_vec(4), frozen, 1.0, base=_vec(4), rewind=True)


def test_encode_rejects_read_only_residual():
    r = _vec(4)
    r.flags.writeable = False
    with pytest.raises(ValueError, match="residual must be writable"):
        encode(r, None, 1.0)


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e39])
def test_encode_rejects_bad_threshold(tau):
    r = _vec(4, 1.0)
    with pytest.raises(ValueError, match="threshold must be finite and > 0"):
        encode(r, None, tau)
    assert np.all(r == 1.0)  # nothing was touched


def test_encode_rejects_bad_form_and_threads():
    with pytest.raises(ValueError, match="form"):
        encode(_vec(), None, 1.0, form="dense")
    with pytest.raises(ValueError, match="form 'empty' cannot hold 1 entries"):
        encode(_vec(4, 2.0)[:1].copy(), None, 1.0, form="empty")
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            encode(_vec(), None, 1.0, threads=threads)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_update_raises_naming_the_index(bad):
    n = 10_000
    r = _vec(n)
    u = _vec(n, 0.5)
    u[7777] = bad
    with pytest.raises(ValueError, match=r"residual \+ update is not finite at index 7777.*must be reset"):
        encode(r, u, 1.0)


def test_overflow_to_inf_raises():
    r = _vec(300, 3e38)
    u = _vec(300, 3e38)
    with pytest.raises(ValueError, match="not finite at index 0"):
        encode(r, u, 1.0)


def test_non_finite_residual_without_update_raises():
    r = _vec(1000)
    r[999] = np.nan
    with pytest.raises(ValueError, match=r"residual is not finite at index 999"):
        encode(r, None, 1.0)


def test_non_finite_with_threads_names_the_first_index():
    n = 100_000
    r = _vec(n)
    u = _vec(n)
    u[[60_000, 90_000]] = np.nan
    with pytest.raises(ValueError, match="index 60000"):
        encode(r, u, 1.0, threads=2)


def test_apply_rejects_bad_arguments():
    m = encode(_vec(8, 2.0), None, 1.0)
    with pytest.raises(ValueError, match="params has 7 elements, expected 8"):
        apply(m, _vec(7))
    with pytest.raises(TypeError, match="params must have dtype float32"):
        apply(m, np.zeros(8))
    with pytest.raises(TypeError, match="message must be a Message"):
        apply(m.to_bytes(), _vec(8))
    with pytest.raises(ValueError, match="not finite"):
        apply(m, _vec(8), scale=float("inf"))
    with pytest.raises(TypeError, match="scale"):
        apply(m, _vec(8), scale="x")
    ro = _vec(8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="params must be writable"):
        apply(m, ro)


def test_apply_scale_and_threshold_rule_object():
    class Rule:
        threshold = 0.25

    r = _vec(8, 0.3)
    m = encode(r, None, Rule())
    assert m.threshold == 0.25 and m.n_entries == 8
    p = _vec(8)
    apply(m, p, scale=-2.0)
    assert np.all(p == np.float32(-0.5))
    assert isinstance(Message.from_bytes(m.to_bytes(), max_params=8), Message)
