"""RMSNorm over the last axis; pairs: cuda/rms_norm.cu, tests/kernels/test_rms_norm.py."""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._numba import SERIAL, njit, widen


def ref(x, w, eps, out=None):
    """x f32[R,H], w [H] -> x / sqrt(mean(x^2) + eps) * w, all fp32. Per-head use: R = T*heads,
    H = D."""
    x = np.asarray(x, np.float32)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    res = x / np.sqrt(ms + np.float32(eps)) * to_f32(w)
    if out is None:
        return res
    out[...] = res
    return out


@njit(**SERIAL)
def _rms_norm(x, w, eps, out):
    # serial: a decode step norms a few rows, where a parallel launch costs more than the work
    H = x.shape[1]
    for r in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(H):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
        for i in range(H):
            out[r, i] = x[r, i] * inv * widen(w[i])


def cpu(x, w, eps, out=None):
    """Same contract as ``ref``; ``out`` may be ``x`` (each row is read before it is written)."""
    x = np.ascontiguousarray(x, np.float32)
    assert x.ndim == 2 and w.shape == (x.shape[1],), (x.shape, w.shape)
    if out is None:
        out = np.empty_like(x)
    _rms_norm(x, np.ascontiguousarray(w), np.float32(eps), out)
    return out
