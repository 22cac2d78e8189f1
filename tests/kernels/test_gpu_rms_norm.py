"""rms_norm.gpu vs ref on the device at awkward sizes, in place too; outputs poisoned with NaN."""
import numpy as np
import pytest

from freetoken.kernels import rms_norm
from freetoken.kernels._bf16 import from_f32
from tests.helpers import assert_close, assert_launches
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu
CASES = [(1, 32), (3, 96), (7, 200), (33, 64), (5, 1000), (2, 4096), (1, 7), (37, 200), (300, 72)]


def _inputs(R, H, dtype):
    rng = np.random.default_rng(R * 1000 + H)
    x = (rng.standard_normal((R, H)) * 3).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    return x, (from_f32(w) if dtype == "bf16" else w)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("R,H", CASES, ids=[f"R{r}-H{h}" for r, h in CASES])
def test_gpu_matches_ref(R, H, dtype):
    cp = load_cupy()
    x, w = _inputs(R, H, dtype)
    out = cp.full((R, H), np.nan, cp.float32)
    assert rms_norm.gpu(cp.asarray(x), cp.asarray(w), 1e-6, out) is out
    assert_close(f"rms_norm gpu R{R} H{H}", rms_norm.ref(x, w, 1e-6), out.get(), 1e-5, 1e-5)


def test_gpu_in_place():
    cp = load_cupy()
    x, w = _inputs(9, 128, "bf16")
    xd = cp.asarray(x)
    rms_norm.gpu(xd, cp.asarray(w), 1e-5, xd)
    assert_close("rms_norm gpu in place", rms_norm.ref(x, w, 1e-5), xd.get(), 1e-5, 1e-5)


def test_gpu_zero_rows_launch_nothing():
    """No rows: no kernel (CUDA rejects a zero grid); one row: one, so the count sees a launch."""
    cp = load_cupy()
    w = cp.ones(64, cp.float32)
    for rows, launched in ((0, 0), (1, 1)):
        x, out = cp.ones((rows, 64), cp.float32), cp.empty((rows, 64), cp.float32)
        assert_launches(lambda: rms_norm.gpu(x, w, 1e-6, out), launched)
    assert_close("rms_norm gpu one row", rms_norm.ref(x.get(), w.get(), 1e-6), out.get(),
                 1e-5, 1e-5)


def test_gpu_rows_where_epsilon_matters():
    """A zero row (0 / sqrt(0 + eps) is 0, not NaN) and rows of magnitude 1e-4, whose mean
    square (1e-8) is small beside eps = 1e-6."""
    cp = load_cupy()
    x, w = _inputs(4, 96, "f32")
    x[0], x[1:] = 0.0, x[1:] * 1e-4
    out = cp.full(x.shape, np.nan, cp.float32)
    rms_norm.gpu(cp.asarray(x), cp.asarray(w), 1e-6, out)
    assert_close("rms_norm gpu, eps-sized rows", rms_norm.ref(x, w, 1e-6), out.get(), 1e-6, 1e-5)


def test_gpu_follows_ref_on_non_finite_rows():
    from tests.kernels.test_rms_norm import non_finite_rows
    cp = load_cupy()
    x, w = non_finite_rows(), np.ones(64, np.float32)
    with np.errstate(all="ignore"):
        want = rms_norm.ref(x, w, 1e-6)
    out = cp.full(x.shape, 7.0, cp.float32)
    got = rms_norm.gpu(cp.asarray(x), cp.asarray(w), 1e-6, out).get()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-5, atol=1e-6)
