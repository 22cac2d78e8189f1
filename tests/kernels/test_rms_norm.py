"""rms_norm: cpu vs ref at awkward sizes, in place, and ref against a float64 formula."""
import numpy as np
import pytest

from freetoken.kernels import rms_norm
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("R,H", [(1, 32), (3, 96), (7, 200), (33, 64)])
def test_cpu_matches_ref(R, H, dtype):
    rng = np.random.default_rng(R + H)
    x = (rng.standard_normal((R, H)) * 3).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    w = from_f32(w) if dtype == np.uint16 else w
    expect = rms_norm.ref(x, w, 1e-6)
    assert_close(f"rms_norm R{R} H{H}", expect, rms_norm.cpu(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    inplace = x.copy()
    assert rms_norm.cpu(inplace, w, 1e-6, out=inplace) is inplace
    assert_close("rms_norm in place", expect, inplace, atol=1e-5, rtol=1e-5)


def test_ref_matches_float64_formula():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = from_f32(rng.standard_normal(96).astype(np.float32))
    x64 = x.astype(np.float64)
    expect = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * to_f32(w)
    assert_close("rms_norm ref vs f64", expect, rms_norm.ref(x, w, 1e-5), atol=1e-6, rtol=1e-5)


def test_eps_dominates_a_zero_row():
    x = np.zeros((2, 32), np.float32)
    x[1] = 1e-4
    w = np.ones(32, np.float32)
    out = rms_norm.cpu(x, w, 1e-2)
    np.testing.assert_array_equal(out[0], 0.0)
    assert_close("rms_norm eps", 1e-4 / np.sqrt(1e-8 + 1e-2) * np.ones(32), out[1], 0, 1e-5)


def non_finite_rows(H=64):
    """A NaN, a +inf, a row of -inf, a value whose square overflows, and a finite row."""
    x = np.random.default_rng(0).standard_normal((5, H)).astype(np.float32)
    x[0, 3], x[1, 2], x[2], x[3, 5] = np.nan, np.inf, -np.inf, 1e30
    return x


def test_cpu_follows_ref_on_non_finite_rows():
    """numba's default error model raised ZeroDivisionError here (on a row holding inf): the
    kernels now divide as numpy does, so NaN and 0 land where ref puts them."""
    x, w = non_finite_rows(), np.ones(64, np.float32)
    with np.errstate(all="ignore"):
        want = rms_norm.ref(x, w, 1e-6)
    got = rms_norm.cpu(x, w, 1e-6)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-5, atol=1e-6)
