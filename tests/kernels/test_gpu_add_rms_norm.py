"""add_rms_norm: gpu vs ref on the device (both the updated x and the normed output, poisoned
with NaN before the launch), plus cpu vs ref here (the op module is new and has no other test);
both on non-finite rows too (ref against the rule in add_rms_norm.py)."""
import numpy as np
import pytest

from freetoken.kernels import add_rms_norm, rms_norm
from freetoken.kernels._bf16 import from_f32
from tests.helpers import assert_close
from tests.helpers import assert_follows_ref
from tests.kernels.test_rms_norm import non_finite_rows
from freetoken.cupy_loader import cupy as load_cupy

CASES = [(1, 32), (3, 96), (7, 200), (33, 64), (2, 4096), (1, 7), (37, 200), (300, 72)]


def _inputs(R, H, dtype):
    rng = np.random.default_rng(R * 1000 + H)
    x = (rng.standard_normal((R, H)) * 3).astype(np.float32)
    res = rng.standard_normal((R, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    return x, res, (from_f32(w) if dtype == "bf16" else w)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("R,H", CASES)
def test_cpu_matches_ref(R, H, dtype):
    x, res, w = _inputs(R, H, dtype)
    x_ref, x_cpu = x.copy(), x.copy()
    expect = add_rms_norm.ref(x_ref, res, w, 1e-6)
    got = add_rms_norm.cpu(x_cpu, res, w, 1e-6)
    np.testing.assert_array_equal(x_ref, x + res)
    assert_close("add_rms_norm x", x_ref, x_cpu, 0, 0)
    assert_close("add_rms_norm out", expect, got, 1e-5, 1e-5)
    assert_close("add_rms_norm = rms_norm(x + res)", rms_norm.ref(x + res, w, 1e-6), expect, 0, 0)


def test_out_must_not_alias_x():
    x, res, w = _inputs(2, 32, "f32")
    with pytest.raises(AssertionError):
        add_rms_norm.cpu(x, res, w, 1e-6, out=x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("R,H", CASES)
def test_gpu_matches_ref(R, H, dtype):
    cp = load_cupy()
    x, res, w = _inputs(R, H, dtype)
    xd, out = cp.asarray(x), cp.full((R, H), np.nan, cp.float32)
    assert add_rms_norm.gpu(xd, cp.asarray(res), cp.asarray(w), 1e-6, out) is out
    x_ref = x.copy()
    expect = add_rms_norm.ref(x_ref, res, w, 1e-6)
    assert_close("add_rms_norm gpu x", x_ref, xd.get(), 0, 0)
    assert_close("add_rms_norm gpu out", expect, out.get(), 1e-5, 1e-5)


def _non_finite_sum():
    """x: rms_norm's non-finite rows (a NaN, a +inf, a row of -inf, a square that overflows, a
    finite row); the residual is finite but for a -inf that the add puts into the finite row."""
    x = non_finite_rows()
    res = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    res[4, 6] = -np.inf
    w = from_f32(np.random.default_rng(3).standard_normal(64).astype(np.float32))
    x_ref = x.copy()
    with np.errstate(all="ignore"):
        want = add_rms_norm.ref(x_ref, res, w, 1e-6)
    return x, res, w, x_ref, want


def test_cpu_follows_ref_on_non_finite_rows():
    """The rule in add_rms_norm.py: the sum is normed as rms_norm does (the finite row that the
    residual's -inf reached: zeros and NaN at the inf), and x keeps the sum, non-finite too."""
    x, res, w, x_ref, want = _non_finite_sum()
    np.testing.assert_array_equal(np.isnan(want[4]), np.arange(64) == 6)
    assert (np.delete(want[4], 6) == 0).all()
    with np.errstate(all="ignore"):
        got = add_rms_norm.cpu(x, res, w, 1e-6)
    np.testing.assert_array_equal(x, x_ref)
    assert_follows_ref(want, got)


@pytest.mark.gpu
def test_gpu_follows_ref_on_non_finite_rows():
    """The same rule on the device: the kernel adds in place and norms each row with one block,
    whose sum of squares must carry NaN and inf as numpy's mean does."""
    cp = load_cupy()
    x, res, w, x_ref, want = _non_finite_sum()
    xd, out = cp.asarray(x), cp.full(x.shape, 7.0, cp.float32)
    add_rms_norm.gpu(xd, cp.asarray(res), cp.asarray(w), 1e-6, out)
    np.testing.assert_array_equal(xd.get(), x_ref)
    assert_follows_ref(want, out.get())
