"""The package's public names: every one in `gradshare.__all__` resolves (lazily: importing gradshare
loads neither torch nor Numba), and the names the guides tell users to import are the real objects."""

from __future__ import annotations

import subprocess
import sys

import gradshare


def test_every_public_name_resolves():
    for name in gradshare.__all__:
        assert getattr(gradshare, name) is not None, name
    assert set(gradshare.__all__) <= set(dir(gradshare))


def test_the_guides_names_are_the_real_objects():
    from gradshare.encoding.threshold import CalibratedThreshold
    from gradshare.replica.losses import clip_grad_norm

    assert gradshare.CalibratedThreshold is CalibratedThreshold
    assert gradshare.clip_grad_norm is clip_grad_norm
    assert {"CalibratedThreshold", "clip_grad_norm"} <= set(gradshare.__all__)


def test_importing_gradshare_loads_no_torch_or_numba():
    code = "import sys, gradshare; print(sorted(m for m in ('torch', 'numba') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
