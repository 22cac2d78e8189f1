"""Dense projection out = x @ w.T, fp32 accumulate; pairs: cuda/linear.cu,
tests/kernels/test_linear.py, bench/kernels/experts_cpu.py (its linear rows)."""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._numba import HOT, dots, njit, prange, split_x, weight_rows, widen_into

ROWS = 32            # weight rows per parallel work item
BLAS_MIN_T = 16      # from this many tokens, widened fp32 blocks + BLAS beat the row GEMV
BLOCK_BYTES = 4 << 20  # fp32 bytes of one widened weight block: stays in the last-level cache


def ref(x, w, out=None):
    """x f32[T,K], w [M,K] (bf16 bits or float) -> f32[T,M]."""
    res = np.asarray(x, np.float32) @ to_f32(w).T
    if out is None:
        return res
    out[...] = res
    return out


@njit(**HOT)
def _gemv(xs, w, toks, out):
    """out[t, m] = dot(xs[t], w[m]); parallel over blocks of ROWS weight rows, each row read once
    for all T tokens. xs f32[T,L,K/L], w [M,K/L] in the row-dot layouts of _numba; toks = 0..T-1.
    (No numpy calls outside the prange: under parallel=True each becomes a parfor to compile.)"""
    T = xs.shape[0]
    M = w.shape[0]
    for b in prange((M + ROWS - 1) // ROWS):
        r = np.empty(T, np.float32)
        for m in range(b * ROWS, min(b * ROWS + ROWS, M)):
            dots(xs, toks, w[m], r)
            for t in range(T):
                out[t, m] = r[t]


def _blas(x, w, out):
    """Many tokens: widen a block of weight rows to fp32 at a time and let BLAS multiply."""
    M, K = w.shape
    if w.dtype == np.float32:
        np.matmul(x, w.T, out=out)
        return out
    rows = max(1, min(M, BLOCK_BYTES // (4 * K)))
    buf = np.empty((rows, K), np.float32)
    for m0 in range(0, M, rows):
        m1 = min(M, m0 + rows)
        widen_into(w[m0:m1], buf[:m1 - m0])
        out[:, m0:m1] = x @ buf[:m1 - m0].T
    return out


def cpu(x, w, out=None):
    """Same contract as ``ref``: numba row GEMV for few tokens (decode), BLAS for many."""
    x = np.ascontiguousarray(x, np.float32)
    T, K = x.shape
    assert w.ndim == 2 and w.shape[1] == K, (x.shape, w.shape)
    w = np.ascontiguousarray(w)
    if out is None:
        out = np.empty((T, w.shape[0]), np.float32)
    if T >= BLAS_MIN_T:
        return _blas(x, w, out)
    rows = weight_rows(w)
    _gemv(split_x(x, rows), rows, np.arange(T, dtype=np.int32), out)
    return out
