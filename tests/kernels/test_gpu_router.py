"""router.gpu vs ref on the device: ids exactly (ties -> lower id), weights within an ulp or
two; outputs poisoned before the launch."""
import numpy as np
import pytest

from freetoken.kernels import router
from tests.helpers import assert_close
from freetoken.cupy_loader import cupy as load_cupy, emulated

pytestmark = pytest.mark.gpu
CASES = [(1, 8, 1), (3, 60, 4), (7, 128, 8), (33, 256, 8), (5, 512, 10), (2, 33, 32), (4, 7, 7),
         (1, 128, 8), (37, 128, 8), (300, 128, 8)]


def _run(logits, k, norm):
    cp = load_cupy()
    T = logits.shape[0]
    out = (cp.full((T, k), -7, cp.int32), cp.full((T, k), np.nan, cp.float32))
    assert router.gpu(cp.asarray(logits), k, norm, out) is out
    return out[0].get(), out[1].get()


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T,E,k", CASES, ids=[f"T{t}-E{e}-k{k}" for t, e, k in CASES])
def test_gpu_matches_ref(T, E, k, norm):
    logits = (np.random.default_rng(T * E + k).standard_normal((T, E)) * 2).astype(np.float32)
    ids, w = _run(logits, k, norm)
    ref_ids, ref_w = router.ref(logits, k, norm)
    np.testing.assert_array_equal(ids, ref_ids)
    assert_close("router weights", ref_w, w, 1e-7, 1e-5)


def test_gpu_ties_go_to_lower_id():
    logits = np.zeros((3, 40), np.float32)
    logits[1, [5, 9, 30]] = 1.0
    logits[2, ::3] = -1.0
    ids, _ = _run(logits, 6, True)
    np.testing.assert_array_equal(ids, router.ref(logits, 6, True)[0])


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("E,k", [(12, 4), (12, 12), (300, 8)])
def test_gpu_follows_ref_on_non_finite_rows(E, k, norm):
    """k valid distinct ids for every row (a NaN once left id -1 and wrote smem_p[-1]), the ref's
    rule for which, NaN weights where ref has them."""
    from tests.kernels.test_router import non_finite_rows
    rows = non_finite_rows(E)
    ids, w = _run(rows, k, norm)
    ref_ids, ref_w = router.ref(rows, k, norm)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(np.isnan(w), np.isnan(ref_w))
    assert_close("router weights, finite rows", ref_w[[2, 5]], w[[2, 5]], 1e-7, 1e-5)


def test_gpu_at_max_e_fits_the_shared_memory_a_launch_gets():
    """MAX_E's probabilities plus the kernel's static shared memory fit in 48 KiB: the launch at
    MAX_E runs, and matches ref."""
    logits = np.random.default_rng(5).standard_normal((2, router.MAX_E)).astype(np.float32)
    ids, w = _run(logits, 8, True)
    np.testing.assert_array_equal(ids, router.ref(logits, 8, True)[0])


def test_device_refuses_shared_memory_past_48_kib_with_the_static_part():
    """One probability more than MAX_E: its dynamic 48,516 bytes fit 48 KiB alone, but not with
    the kernel's 640 static bytes; a real launch fails with CUDA's code (CUDA_ERROR_INVALID_VALUE
    on an H200), and the emulated one says why."""
    from freetoken.device_limits import TOO_MUCH_SHARED
    from freetoken.kernels import _cuda
    cp = load_cupy()
    E = router.MAX_E + 1
    args = (cp.zeros((1, E), cp.float32), cp.zeros(1, cp.int32), cp.zeros(1, cp.float32),
            *(np.int32(n) for n in (1, E, 1, 1)))
    with pytest.raises(Exception, match=TOO_MUCH_SHARED) as err:
        _cuda.kernel("router", "router_f32")((1,), (256,), args, shared_mem=4 * E)
        cp.cuda.runtime.deviceSynchronize()
    assert "640 bytes of static" in str(err.value) or not emulated()
