"""gated_rms_norm.gpu vs ref on the device at awkward sizes, in place of x and of z, and on
non-finite rows and gates; outputs poisoned with NaN (7.0 where NaN is a right answer)."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import gated_rms_norm
from freetoken.kernels._bf16 import from_f32
from tests.helpers import assert_close, assert_launches
from tests.helpers import assert_follows_ref
from tests.kernels.test_gated_rms_norm import gated_args, non_finite_gated

pytestmark = pytest.mark.gpu
CASES = [(1, 32), (3, 96), (7, 200), (33, 64), (2, 1000), (1, 7), (128, 128)]


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("R,D", CASES, ids=[f"R{r}-D{d}" for r, d in CASES])
def test_gpu_matches_ref(R, D, dtype):
    cp = load_cupy()
    x, z, w = gated_args(np.random.default_rng(R * 1000 + D), R, D, dtype)
    out = cp.full((R, D), np.nan, cp.float32)
    assert gated_rms_norm.gpu(cp.asarray(x), cp.asarray(z), cp.asarray(w), 1e-6, out) is out
    assert_close(f"gated_rms_norm gpu R{R} D{D}", gated_rms_norm.ref(x, z, w, 1e-6), out.get(),
                 1e-5, 1e-5)


@pytest.mark.parametrize("target", ["x", "z"])
def test_gpu_in_place(target):
    cp = load_cupy()
    x, z, w = gated_args(np.random.default_rng(9), 9, 128, "bf16")
    dx, dz = cp.asarray(x), cp.asarray(z)
    gated_rms_norm.gpu(dx, dz, cp.asarray(w), 1e-6, dx if target == "x" else dz)
    got = (dx if target == "x" else dz).get()
    assert_close(f"in place of {target}", gated_rms_norm.ref(x, z, w, 1e-6), got, 1e-5, 1e-5)


def test_gpu_zero_rows_launch_nothing():
    """No rows: no kernel (CUDA rejects a zero grid); one row: one, so the count sees a launch."""
    cp = load_cupy()
    w = cp.ones(128, cp.float32)
    for rows, launched in ((0, 0), (1, 1)):
        x, out = cp.ones((rows, 128), cp.float32), cp.empty((rows, 128), cp.float32)
        assert_launches(lambda: gated_rms_norm.gpu(x, x, w, 1e-6, out), launched)
    assert_close("gated_rms_norm gpu one row", gated_rms_norm.ref(x.get(), x.get(), w.get(), 1e-6),
                 out.get(), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_gpu_follows_ref_on_non_finite_rows(dtype):
    """The rule in gated_rms_norm.py on the device: a NaN or -inf row all NaN, an inf or an
    overflowing square zeros (NaN at the inf), a NaN, -inf or +inf gate NaN, NaN, +-inf."""
    cp = load_cupy()
    x, z, w = non_finite_gated()
    w = from_f32(w) if dtype == "bf16" else w
    with np.errstate(all="ignore"):
        want = gated_rms_norm.ref(x, z, w, 1e-6)
    out = cp.full(x.shape, 7.0, cp.float32)
    gated_rms_norm.gpu(cp.asarray(x), cp.asarray(z), cp.asarray(w), 1e-6, out)
    assert_follows_ref(want, out.get())


@pytest.mark.heavy
def test_gpu_qwen36_prefill_rows():
    """A 256-token prefill of Qwen3.6's 32 value heads of 128."""
    cp = load_cupy()
    x, z, w = gated_args(np.random.default_rng(3), 256 * 32, 128, "bf16")
    out = cp.full(x.shape, np.nan, cp.float32)
    gated_rms_norm.gpu(cp.asarray(x), cp.asarray(z), cp.asarray(w), 1e-6, out)
    assert_close("gated_rms_norm qwen3.6", gated_rms_norm.ref(x, z, w, 1e-6), out.get(), 1e-5, 1e-5)
