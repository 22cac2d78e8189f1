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


# --- gpu: cuda/rms_norm.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "rms_norm_bf16": ("x:f32*", "w:u16*", "y:f32*", "R:i32", "H:i32", "eps:f32"),
    "rms_norm_f32": ("x:f32*", "w:f32*", "y:f32*", "R:i32", "H:i32", "eps:f32"),
}


def gpu(x, w, eps, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[R,H] is required and may be ``x``."""
    from freetoken.kernels import _cuda
    R, H = x.shape
    assert w.shape == (H,) and out.shape == (R, H), (x.shape, w.shape, out.shape)
    entry = f"rms_norm_{_cuda.dtype_tag(w)}"
    args = _cuda.bind(ARGS[entry], x=x, w=w, y=out, R=R, H=H, eps=eps)
    _cuda.launch(_cuda.kernel("rms_norm", entry), (R,), (_cuda.threads(H, 512),), args)
    return out
