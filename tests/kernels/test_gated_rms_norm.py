"""gated_rms_norm: ref against a float64 formula (HF's Qwen3NextRMSNormGated in fp32: norm, then
the weight as stored, then silu of the gate), cpu vs ref at awkward sizes, in place."""
import numpy as np
import pytest

from freetoken.kernels import gated_rms_norm
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close


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
