"""Rotary position embedding, NeoX rotate-half; pairs: cuda/rope.cu, tests/kernels/test_rope.py.

Element i of a head pairs with element i + R/2, R = 2 * len(inv_freq); the angle is
float32(pos) * inv_freq[i] (an fp32 product). The contract has R = D; a shorter inv_freq
(partial rotary, as in Qwen3.5) rotates the first R elements and copies the rest.
"""
import numpy as np

from freetoken.kernels._numba import HOT, SERIAL, njit, prange


def ref(x, positions, inv_freq, out=None):
    """x f32[T,nh,D], positions int32[T], inv_freq f32[R/2] -> f32[T,nh,D]."""
    x = np.asarray(x, np.float32)
    half = inv_freq.shape[0]
    ang = np.asarray(positions).astype(np.float32)[:, None] * inv_freq.astype(np.float32)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]      # [T,1,R/2]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    res = x.copy()
    res[..., :half] = x1 * cos - x2 * sin
    res[..., half:2 * half] = x2 * cos + x1 * sin
    if out is None:
        return res
    out[...] = res
    return out


PARALLEL_MIN_T = 64   # tokens from which the rotation runs on every core: below, a parallel
                      # launch costs more than the work (a decode step's q and k of 1-8 tokens)


@njit(inline="always", **SERIAL)
def _rope_token(x, positions, inv_freq, out, t):
    nh, D = x.shape[1], x.shape[2]
    half = inv_freq.shape[0]
    pos = np.float32(positions[t])
    for i in range(half):
        a = pos * inv_freq[i]
        c = np.cos(a)
        s = np.sin(a)
        for h in range(nh):
            x1 = x[t, h, i]
            x2 = x[t, h, i + half]
            out[t, h, i] = x1 * c - x2 * s
            out[t, h, i + half] = x2 * c + x1 * s
    for h in range(nh):     # partial rotary tail; a loop, not a slice copy (nested parfor)
        for i in range(2 * half, D):
            out[t, h, i] = x[t, h, i]


@njit(**HOT)
def _rope(x, positions, inv_freq, out):
    for t in prange(x.shape[0]):
        _rope_token(x, positions, inv_freq, out, t)


@njit(**SERIAL)
def _rope_few(x, positions, inv_freq, out):
    for t in range(x.shape[0]):
        _rope_token(x, positions, inv_freq, out, t)


def cpu(x, positions, inv_freq, out=None):
    """Same contract as ``ref``; ``out`` may be ``x`` (both halves are read before writing)."""
    x = np.ascontiguousarray(x, np.float32)
    assert x.ndim == 3 and 2 * inv_freq.shape[0] <= x.shape[2], (x.shape, inv_freq.shape)
    if out is None:
        out = np.empty_like(x)
    (_rope if x.shape[0] >= PARALLEL_MIN_T else _rope_few)(
        x, np.ascontiguousarray(positions, np.int32), np.ascontiguousarray(inv_freq, np.float32), out)
    return out


# --- gpu: cuda/rope.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "rope_f32": ("x:f32*", "positions:i32*", "inv_freq:f32*", "out:f32*", "T:i32", "nh:i32",
                 "D:i32", "half:i32"),
}


def gpu(x, positions, inv_freq, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,nh,D] is required and may be ``x``."""
    from freetoken.kernels import _cuda
    T, nh, D = x.shape
    (half,) = inv_freq.shape
    assert 2 * half <= D and positions.shape == (T,) and out.shape == x.shape, \
        (x.shape, positions.shape, inv_freq.shape, out.shape)
    args = _cuda.bind(ARGS["rope_f32"], x=x, positions=positions, inv_freq=inv_freq, out=out,
                      T=T, nh=nh, D=D, half=half)
    _cuda.launch(_cuda.kernel("rope", "rope_f32"), (T,), (_cuda.threads(half, 256),), args)
    return out
