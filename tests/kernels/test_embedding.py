"""embedding: cpu vs ref (bitwise: a gather and a widening), and ref against known bf16 values."""
import numpy as np
import pytest

from freetoken.kernels import embedding
from freetoken.kernels._bf16 import from_f32


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("T,H", [(1, 96), (3, 200), (7, 96), (33, 200)])
def test_cpu_matches_ref(T, H, dtype):
    rng = np.random.default_rng(T * H)
    table = rng.standard_normal((50, H)).astype(np.float32)
    table = from_f32(table) if dtype == np.uint16 else table
    ids = rng.integers(0, 50, T).astype(np.int32)
    ids[0] = ids[-1]                                      # a repeated id
    expect = embedding.ref(ids, table)
    assert expect.dtype == np.float32 and expect.shape == (T, H)
    np.testing.assert_array_equal(embedding.cpu(ids, table), expect)
    out = np.full((T, H), np.nan, np.float32)
    assert embedding.cpu(ids, table, out=out) is out
    np.testing.assert_array_equal(out, expect)


def test_ref_widens_bf16_bits():
    table = np.array([[0x3F80, 0xC000, 0x0000, 0x7F80]], np.uint16)  # 1, -2, 0, inf
    np.testing.assert_array_equal(embedding.ref(np.array([0, 0], np.int32), table),
                                  np.array([[1.0, -2.0, 0.0, np.inf]] * 2, np.float32))
