"""logprobs.gpu vs ref on the device: top ids exactly (ties -> lower id), logprobs within a few
ulps (CUDA's expf/logf and a block-tree sum); outputs poisoned before the launch; k = 0; the
wrapper's refusals."""
import numpy as np
import pytest

from freetoken.kernels import logprobs
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu
ATOL, RTOL = 1e-5, 1e-6


def _run(logits, chosen, k):
    cp = load_cupy()
    B = logits.shape[0]
    out = (cp.full(B, np.nan, cp.float32), cp.full((B, k), -7, cp.int32),
           cp.full((B, k), np.nan, cp.float32))
    assert logprobs.gpu(cp.asarray(logits), cp.asarray(chosen), k, out) is out
    return tuple(a.get() for a in out)


def _check(logits, chosen, k):
    got, expect = _run(logits, chosen, k), logprobs.ref(logits, chosen, k)
    np.testing.assert_array_equal(got[1], expect[1])
    np.testing.assert_allclose(got[0], expect[0], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(got[2], expect[2], atol=ATOL, rtol=RTOL)
    return got


def _rows(rng, B, V, scale=3.0):
    return (rng.standard_normal((B, V)) * scale).astype(np.float32), \
        rng.integers(0, V, B).astype(np.int32)


@pytest.mark.parametrize("B,V,k", [(1, 1, 1), (3, 5, 5), (7, 33, 20), (2, 1000, 32),
                                   (17, 1025, 20), (4, 20000, 20), (5, 300, 0)])
def test_gpu_matches_ref(B, V, k):
    _check(*_rows(np.random.default_rng(B * V + k), B, V), k)


@pytest.mark.heavy
def test_gpu_full_vocabulary():
    _check(*_rows(np.random.default_rng(5), 8, 151936), 20)


@pytest.mark.parametrize("V", [40, 3000])
def test_gpu_ties_go_to_the_lower_id(V):
    """Integer logits tie within and across the threads' lists; a flat row; a tied top."""
    rng = np.random.default_rng(V)
    logits, chosen = _rows(rng, 6, V)
    logits = np.round(logits)
    logits[1] = 0.0
    logits[2, ::5] = logits[2].max()
    logits[3, : V // 2] = 1.0
    got = _check(logits, chosen, 20)
    np.testing.assert_array_equal(got[1][1], np.arange(20))


def test_gpu_underflow_large_logits_and_minus_inf():
    rng = np.random.default_rng(6)
    logits, chosen = _rows(rng, 4, 5000, 1.0)
    logits[0, 123] = 200.0                        # every other exp underflows
    logits[1] *= np.float32(1e4)
    logits[2, 10:] = -np.inf                      # masked tokens: lp -inf, last in the order
    chosen[2] = 50
    got = _check(logits, chosen, 20)
    assert got[2][0, 0] == 0.0 and got[0][2] == -np.inf


def test_gpu_k_zero_writes_only_the_chosen():
    rng = np.random.default_rng(7)
    logits, chosen = _rows(rng, 3, 4000)
    lp_chosen, ids, lps = _check(logits, chosen, 0)
    assert ids.shape == lps.shape == (3, 0) and np.isfinite(lp_chosen).all()


def test_gpu_chosen_outside_the_row_is_nan():
    lp_chosen, _, _ = _run(np.zeros((2, 64), np.float32), np.array([-1, 64], np.int32), 1)
    assert np.isnan(lp_chosen).all()


def test_gpu_refuses_k_above_its_limit():
    cp = load_cupy()
    k = logprobs.MAX_K + 1
    logits, chosen = cp.zeros((1, 100), cp.float32), cp.zeros(1, cp.int32)
    out = (cp.empty(1, cp.float32), cp.empty((1, k), cp.int32), cp.empty((1, k), cp.float32))
    with pytest.raises(ValueError, match="above the kernel's limit"):
        logprobs.gpu(logits, chosen, k, out)


def test_eager_backend_allocates_or_takes_out():
    """ops.logprobs on the cuda backend: `out` allocated when absent, else the last positional."""
    from freetoken.backend import get_ops
    ops = get_ops("cuda")
    logits, chosen = _rows(np.random.default_rng(8), 3, 500)
    got = ops.logprobs(logits, chosen, 4)
    out = tuple(ops.xp.empty_like(a) for a in got)
    assert ops.logprobs(logits, chosen, 4, out) is out
    expect = logprobs.ref(logits, chosen, 4)
    for a, b in zip(out, expect):
        np.testing.assert_allclose(a.get(), b, atol=ATOL, rtol=RTOL)


def test_gpu_follows_ref_on_non_finite_rows():
    """ids as ref's (an all-NaN row once came back [0, 16, 8]), NaN where ref has NaN."""
    from tests.kernels.test_logprobs import non_finite_rows
    cp = load_cupy()
    rows, chosen = non_finite_rows()
    k, B = 3, rows.shape[0]
    out = (cp.full(B, 7, cp.float32), cp.full((B, k), -7, cp.int32), cp.full((B, k), 7, cp.float32))
    got = [a.get() for a in logprobs.gpu(cp.asarray(rows), cp.asarray(chosen), k, out)]
    want = logprobs.ref(rows, chosen, k)
    np.testing.assert_array_equal(got[1], want[1])
    for w, g in ((want[0], got[0]), (want[2], got[2])):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], rtol=1e-5, atol=1e-5)
