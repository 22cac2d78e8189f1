"""linear: cpu vs ref across the GEMV (few tokens) and BLAS (many tokens) paths, bf16 and fp32."""
import numpy as np
import pytest

from freetoken.kernels import linear
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close


def weights(rng, M, K, dtype):
    w = (rng.standard_normal((M, K)) / np.sqrt(K)).astype(np.float32)
    return from_f32(w) if dtype == np.uint16 else w


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("T", [1, 3, 7, 33])             # 33 takes the BLAS path
@pytest.mark.parametrize("M,K", [(77, 96), (40, 200), (33, 97)])   # 97: bf16 rows of odd length
def test_cpu_matches_ref(T, M, K, dtype):
    rng = np.random.default_rng(T * M + K)
    w = weights(rng, M, K, dtype)
    x = rng.standard_normal((T, K)).astype(np.float32)
    expect = linear.ref(x, w)
    assert expect.shape == (T, M)
    assert_close(f"linear T{T} M{M} K{K}", expect, linear.cpu(x, w), atol=1e-5, rtol=1e-4)
    out = np.full((T, M), np.nan, np.float32)
    assert linear.cpu(x, w, out=out) is out
    assert_close("linear out=", expect, out, atol=1e-5, rtol=1e-4)


def test_blas_path_widens_in_several_blocks(monkeypatch):
    monkeypatch.setattr(linear, "BLOCK_BYTES", 96 * 4 * 5)   # 5 rows per block, 77 rows
    rng = np.random.default_rng(5)
    w, x = weights(rng, 77, 96, np.uint16), rng.standard_normal((40, 96)).astype(np.float32)
    assert_close("linear blocks", linear.ref(x, w), linear.cpu(x, w), atol=1e-5, rtol=1e-4)


def test_ref_matches_float64():
    rng = np.random.default_rng(2)
    w, x = weights(rng, 9, 200, np.uint16), rng.standard_normal((3, 200)).astype(np.float32)
    expect = x.astype(np.float64) @ to_f32(w).astype(np.float64).T
    assert_close("linear ref vs f64", expect, linear.ref(x, w), atol=1e-5, rtol=1e-5)
