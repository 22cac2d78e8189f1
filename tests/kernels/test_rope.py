"""rope: ref against a complex rotation; cpu vs ref (head dims, long positions, partial rotary,
in place)."""
import numpy as np
import pytest

from freetoken.kernels import rope
from tests.helpers import assert_close


def inv_freq(D, theta=10000.0):
    return (1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)


def test_ref_is_a_complex_rotation_of_half_pairs():
    rng = np.random.default_rng(0)
    T, nh, D = 5, 3, 64
    x = rng.standard_normal((T, nh, D)).astype(np.float32)
    pos = np.array([0, 1, 17, 4095, 32000], np.int32)
    freq = inv_freq(D)
    ang = (pos.astype(np.float32)[:, None] * freq).astype(np.float64)        # fp32 product
    z = (x[..., :D // 2] + 1j * x[..., D // 2:]).astype(np.complex128)       # pair (i, i + D/2)
    z = z * np.exp(1j * ang)[:, None, :]
    expect = np.concatenate([z.real, z.imag], axis=-1)
    assert_close("rope ref vs complex", expect, rope.ref(x, pos, freq), atol=2e-6, rtol=1e-5)
    np.testing.assert_array_equal(rope.ref(x, np.zeros(T, np.int32), freq), x)


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 7, 33, rope.PARALLEL_MIN_T + 1])   # serial and parallel kernels
def test_cpu_matches_ref(T, D):
    rng = np.random.default_rng(T * D)
    x = rng.standard_normal((T, 4, D)).astype(np.float32)
    pos = rng.integers(0, 40000, T).astype(np.int32)
    expect = rope.ref(x, pos, inv_freq(D))
    assert_close(f"rope T{T} D{D}", expect, rope.cpu(x, pos, inv_freq(D)), atol=1e-5, rtol=1e-5)
    inplace = x.copy()
    assert rope.cpu(inplace, pos, inv_freq(D), out=inplace) is inplace
    assert_close("rope in place", expect, inplace, atol=1e-5, rtol=1e-5)


def test_partial_rotary_copies_the_tail():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rope.PARALLEL_MIN_T, 2, 64)).astype(np.float32)
    pos = rng.integers(0, 400, rope.PARALLEL_MIN_T).astype(np.int32)
    freq = inv_freq(16)                                   # rotate the first 16 of 64 dims
    expect = rope.ref(x, pos, freq)
    assert_close("rope partial, few", expect[:3], rope.cpu(x[:3], pos[:3], freq), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(expect[..., 16:], x[..., 16:])
    np.testing.assert_array_equal(expect[..., :16], rope.ref(x[..., :16], pos, freq))
    assert_close("rope partial", expect, rope.cpu(x, pos, freq), atol=1e-5, rtol=1e-5)
