"""router.gpu vs ref on the device: ids exactly (ties -> lower id), weights within an ulp or
two; outputs poisoned before the launch."""
import numpy as np
import pytest

from freetoken.kernels import router
from tests.helpers import assert_close
from freetoken.cupy_loader import cupy as load_cupy

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
