"""embedding.gpu vs ref on the device; outputs poisoned with NaN so unwritten rows fail."""
import numpy as np
import pytest

from freetoken.kernels import embedding
from freetoken.kernels._bf16 import from_f32
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T,H,V", [(1, 32, 5), (3, 96, 1000), (7, 200, 33), (33, 2048, 4097)])
def test_gpu_matches_ref(T, H, V, dtype):
    cp = load_cupy()
    rng = np.random.default_rng(T * H + V)
    table = rng.standard_normal((V, H)).astype(np.float32)
    table = from_f32(table) if dtype == "bf16" else table
    ids = rng.integers(0, V, T).astype(np.int32)
    out = cp.full((T, H), np.nan, cp.float32)
    assert embedding.gpu(cp.asarray(ids), cp.asarray(table), out) is out
    np.testing.assert_array_equal(out.get(), embedding.ref(ids, table))


def test_gpu_out_of_range_id_gives_nan_row():
    cp = load_cupy()
    table = cp.ones((4, 64), cp.float32)
    out = cp.zeros((3, 64), cp.float32)
    embedding.gpu(cp.asarray([0, 4, -1], dtype=cp.int32), table, out)
    host = out.get()
    assert (host[0] == 1).all() and np.isnan(host[1:]).all()
