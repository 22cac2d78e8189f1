"""kv_write: cpu vs ref bitwise (bf16 rounding to nearest even, fp32 caches); other slots stay
untouched."""
import numpy as np
import pytest

from freetoken.kernels import kv_write
from freetoken.kernels._bf16 import from_f32


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("T,G,D", [(1, 1, 32), (7, 2, 64), (33, 4, 128)])
def test_cpu_matches_ref(T, G, D, dtype):
    rng = np.random.default_rng(T * G * D)
    N = 2 * T + 5
    k = rng.standard_normal((T, G, D)).astype(np.float32)
    v = rng.standard_normal((T, G, D)).astype(np.float32)
    slots = rng.permutation(N)[:T].astype(np.int32)       # shuffled, non-contiguous
    init = rng.integers(0, 1 << 15, (N, G, D)).astype(dtype)
    caches = [init.copy() for _ in range(4)]
    kv_write.ref(k, v, caches[0], caches[1], slots)
    kv_write.cpu(k, v, caches[2], caches[3], slots)
    np.testing.assert_array_equal(caches[2], caches[0])
    np.testing.assert_array_equal(caches[3], caches[1])
    untouched = np.setdiff1d(np.arange(N), slots)
    np.testing.assert_array_equal(caches[2][untouched], init[untouched])
    expect = from_f32(k) if dtype == np.uint16 else k
    np.testing.assert_array_equal(caches[0][slots], expect)


def test_bf16_rounding_ties_and_nan():
    # 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0);
    # 1 + 3 * 2^-8 rounds up to the even 1 + 2^-6; NaN stays a quiet NaN
    vals = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -1 - 2 ** -8, np.nan, np.inf, 0.0],
                    np.float32).reshape(6, 1, 1)
    k_cache, v_cache = np.zeros((6, 1, 1), np.uint16), np.zeros((6, 1, 1), np.uint16)
    kv_write.cpu(vals, vals, k_cache, v_cache, np.arange(6, dtype=np.int32))
    np.testing.assert_array_equal(k_cache.ravel(), [0x3F80, 0x3F82, 0xBF80, 0x7FC0, 0x7F80, 0])
    np.testing.assert_array_equal(v_cache, k_cache)


@pytest.mark.parametrize("T", [1, 70])
@pytest.mark.parametrize("bad", [-1, 3])
def test_out_of_range_slot_raises_before_any_write(T, bad):
    """Every slot is checked before one is written: a bad last slot leaves the caches as they were."""
    k = np.ones((T, 1, 4), np.float32)
    cache = np.zeros((3, 1, 4), np.float32)
    slots = np.zeros(T, np.int32)
    slots[-1] = bad
    with pytest.raises(IndexError, match=f"slot {bad} out of range"):
        kv_write.cpu(k, k, cache, cache, slots)
    assert not cache.any()
