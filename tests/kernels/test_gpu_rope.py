"""rope.gpu vs ref on the device: full and partial rotary, large positions, in place; outputs
poisoned with NaN so an unwritten element (e.g. the partial-rotary tail) fails."""
import numpy as np
import pytest

from freetoken.kernels import rope
from tests.helpers import assert_close
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu
# (T, heads, D, rotary dims R): odd T, one head, partial rotary (Qwen3.5: R = D/4), R = D
CASES = [(1, 1, 64, 64), (3, 5, 128, 128), (7, 4, 256, 64), (33, 2, 96, 32), (2, 3, 10, 6), (37, 4, 128, 128), (300, 2, 64, 64)]


def _inputs(T, nh, D, R):
    rng = np.random.default_rng(T * nh + D + R)
    x = rng.standard_normal((T, nh, D)).astype(np.float32)
    pos = rng.integers(0, 40000, T).astype(np.int32)
    inv_freq = (1.0 / 1e6 ** (np.arange(0, R, 2) / R)).astype(np.float32)
    return x, pos, inv_freq


@pytest.mark.parametrize("T,nh,D,R", CASES, ids=[f"T{t}-h{h}-D{d}-R{r}" for t, h, d, r in CASES])
def test_gpu_matches_ref(T, nh, D, R):
    cp = load_cupy()
    x, pos, inv_freq = _inputs(T, nh, D, R)
    out = cp.full(x.shape, np.nan, cp.float32)
    assert rope.gpu(cp.asarray(x), cp.asarray(pos), cp.asarray(inv_freq), out) is out
    # sincosf vs numpy's float32 sin/cos at angles up to 4e4 rad: a few ulp of the angle
    assert_close("rope gpu", rope.ref(x, pos, inv_freq), out.get(), 2e-5, 1e-4)


def test_gpu_in_place():
    cp = load_cupy()
    x, pos, inv_freq = _inputs(5, 3, 64, 32)
    xd = cp.asarray(x)
    rope.gpu(xd, cp.asarray(pos), cp.asarray(inv_freq), xd)
    assert_close("rope gpu in place", rope.ref(x, pos, inv_freq), xd.get(), 2e-5, 1e-4)
