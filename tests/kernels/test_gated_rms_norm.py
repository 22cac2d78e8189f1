"""gated_rms_norm: ref against a float64 formula (HF's Qwen3NextRMSNormGated in fp32: norm, then
the weight as stored, then silu of the gate), cpu vs ref at awkward sizes, in place, and on
non-finite rows and gates (ref against the rule in gated_rms_norm.py, cpu against ref)."""
import numpy as np
import pytest

from freetoken.kernels import gated_rms_norm
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close, assert_follows_ref


def gated_args(rng, R, D, dtype):
    x = (rng.standard_normal((R, D)) * 3).astype(np.float32)
    z = (rng.standard_normal((R, D)) * 4).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    return x, z, (from_f32(w) if dtype == "bf16" else w)


def test_ref_matches_float64_formula():
    x, z, w = gated_args(np.random.default_rng(1), 6, 128, "bf16")
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    normed = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    expect = normed * to_f32(w) * (z64 / (1 + np.exp(-z64)))
    assert_close("gated_rms_norm ref vs f64", expect, gated_rms_norm.ref(x, z, w, 1e-6), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
# the last shape runs the parallel driver
@pytest.mark.parametrize("R,D", [(1, 32), (3, 96), (7, 200), (128, 128), (131, 128), (2049, 128)])
def test_cpu_matches_ref(R, D, dtype):
    x, z, w = gated_args(np.random.default_rng(R + D), R, D, dtype)
    expect = gated_rms_norm.ref(x, z, w, 1e-6)
    assert_close(f"gated_rms_norm R{R} D{D}", expect, gated_rms_norm.cpu(x, z, w, 1e-6), 1e-5, 1e-5)
    for target in ("x", "z"):
        a, b = x.copy(), z.copy()
        out = a if target == "x" else b
        assert gated_rms_norm.cpu(a, b, w, 1e-6, out=out) is out
        assert_close(f"in place of {target}", expect, out, 1e-5, 1e-5)


def test_extreme_gates_and_a_zero_row():
    """silu of a very negative gate is -0 (no overflow to NaN), of a large one the gate itself;
    a zero row stays zero (eps keeps the rsqrt finite)."""
    x = np.ones((2, 64), np.float32)
    x[1] = 0
    z = np.tile(np.array([-200, -90, 0, 90, 200, 1, -1, 5], np.float32), (2, 8))
    w = np.ones(64, np.float32)
    expect = gated_rms_norm.ref(x, z, w, 1e-6)
    got = gated_rms_norm.cpu(x, z, w, 1e-6)
    assert np.isfinite(got).all()
    assert_close("extreme gates", expect, got, 1e-6, 1e-6)
    np.testing.assert_array_equal(got[1], 0)


def non_finite_gated(D=64):
    """rms_norm's non-finite rows as x (a NaN, a +inf, a row of -inf, a value whose square
    overflows, a finite row); the gate z is finite but for a NaN, a +inf and a -inf in the finite
    row (columns 1, 7, 9)."""
    from tests.kernels.test_rms_norm import non_finite_rows
    x = non_finite_rows(D)
    rng = np.random.default_rng(1)
    z = (rng.standard_normal(x.shape) * 4).astype(np.float32)
    z[4, 1], z[4, 7], z[4, 9] = np.nan, np.inf, -np.inf
    return x, z, rng.standard_normal(D).astype(np.float32)


def test_ref_follows_the_non_finite_rule():
    """The rule in gated_rms_norm.py's docstring, read off ref: the mean square decides the row
    (NaN: all NaN; inf: finite entries 0, infinite ones NaN), the gate acts per element."""
    x, z, w = non_finite_gated()
    with np.errstate(all="ignore"):
        got = gated_rms_norm.ref(x, z, w, 1e-6)
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    np.testing.assert_array_equal(np.isnan(got[1]), np.arange(64) == 2)
    assert (np.delete(got[1], 2) == 0).all() and (got[3] == 0).all()
    np.testing.assert_array_equal(np.isnan(got[4]), np.isin(np.arange(64), [1, 9]))
    assert np.isinf(got[4, 7]) and np.isfinite(np.delete(got[4], [1, 7, 9])).all()


@pytest.mark.parametrize("copies", [1, 820])             # 820 x 5 rows of 64: the parallel driver
def test_cpu_follows_ref_on_non_finite_rows(copies):
    """fastmath's no-NaN/no-inf assumptions made the kernel give NaN rows for an inf or an
    overflowing square (ref: 0 and NaN) and NaN for silu(+inf) (ref: +-inf): it now compiles
    without them, and NaN, inf and 0 land where ref puts them."""
    x, z, w = non_finite_gated()
    x, z = np.tile(x, (copies, 1)), np.tile(z, (copies, 1))
    with np.errstate(all="ignore"):
        want = gated_rms_norm.ref(x, z, w, 1e-6)
    assert_follows_ref(want, gated_rms_norm.cpu(x, z, w, 1e-6))
