"""Gated RMSNorm, the Gated DeltaNet output norm: x * rsqrt(mean(x^2) + eps) * w * silu(z) over
the last axis (per value head: R = T*Hv rows of D = Dv); pairs: cuda/gated_rms_norm.cu,
tests/kernels/test_gated_rms_norm.py. The weight is used as stored (no 1+w, unlike the
model's other norms).

Non-finite inputs (cpu and gpu follow ``ref``): the row's mean square decides all D outputs. A NaN
in the row's x makes every output NaN (so does a row of -inf: inf / inf). Otherwise an inf of
either sign, or a square that overflows fp32 (|x| above ~1.8e19), makes the mean square inf: the
row's finite x give 0 (times a finite gate) and its infinite ones NaN. The gate acts per element:
silu(NaN) and silu(-inf) (-inf / inf) are NaN, so those outputs are NaN; silu(+inf) is +inf, so
that output is +-inf (NaN where the normed x * w is 0).
"""
import numpy as np

from freetoken.kernels._activations import silu
from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._numba import HOT_NAN_SAFE, SERIAL_NAN_SAFE, njit, prange, widen


def ref(x, z, w, eps, out=None):
    """x f32[R,D], z f32[R,D], w [D] (bf16 bits or f32) -> f32[R,D], all fp32."""
    x = np.asarray(x, np.float32)
    z = np.asarray(z, np.float32)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    with np.errstate(over="ignore"):               # exp(-z) -> inf for z << 0: silu -> -0
        gate = z / (np.float32(1.0) + np.exp(-z))
    res = x / np.sqrt(ms + np.float32(eps)) * to_f32(w) * gate
    if out is None:
        return res
    out[...] = res
    return out


# --- cpu: numba ---

ROWS = 64  # rows per parallel work item
PARALLEL_MIN = 1 << 18  # R*D from which the parallel driver runs (64 tokens of 32 heads of 128)
# error_model "numpy" (division by zero unchecked) lets the silu loop vectorize; NaN-safe math:
# with all of fastmath 1 / sqrt(inf) came out NaN (arcp + afn + ninf), so a row holding an inf
# or an overflowing square was all NaN instead of ref's zeros, and silu(+inf) was NaN


@njit(**SERIAL_NAN_SAFE)
def _rows(x, z, w, eps, out, r0, r1):
    D = x.shape[1]
    for r in range(r0, r1):
        ss = np.float32(0.0)
        for i in range(D):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(D) + eps)
        for i in range(D):
            out[r, i] = x[r, i] * inv * widen(w[i]) * silu(z[r, i])


# a decode step (R = 4*32 rows, ~6 us) runs serially: a parallel region costs about as much and,
# on a loaded machine, waits milliseconds for a descheduled worker; a prefill runs in parallel
@njit(**HOT_NAN_SAFE)
def _rows_parallel(x, z, w, eps, out):
    R = x.shape[0]
    for q in prange((R + ROWS - 1) // ROWS):
        _rows(x, z, w, eps, out, q * ROWS, min(R, (q + 1) * ROWS))


def cpu(x, z, w, eps, out=None):
    """Same contract as ``ref``; ``out`` may be ``x`` or ``z`` (each row is read before it is
    written, each element of z just before its own write)."""
    x = np.ascontiguousarray(x, np.float32)
    z = np.ascontiguousarray(z, np.float32)
    assert z.shape == x.shape and w.shape == (x.shape[1],), (x.shape, z.shape, w.shape)
    if out is None:
        out = np.empty_like(x)
    w = np.ascontiguousarray(w)
    if x.size >= PARALLEL_MIN:
        _rows_parallel(x, z, w, np.float32(eps), out)
    else:
        _rows(x, z, w, np.float32(eps), out, 0, x.shape[0])
    return out


# --- gpu: cuda/gated_rms_norm.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "gated_rms_norm_bf16": ("x:f32*", "z:f32*", "w:u16*", "y:f32*", "R:i32", "D:i32", "eps:f32"),
    "gated_rms_norm_f32": ("x:f32*", "z:f32*", "w:f32*", "y:f32*", "R:i32", "D:i32", "eps:f32"),
}


def gpu(x, z, w, eps, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[R,D] is required and may be ``x``
    or ``z``. One block per row, as rms_norm."""
    from freetoken.kernels import _cuda
    R, D = x.shape
    assert z.shape == (R, D) and w.shape == (D,) and out.shape == (R, D), (
        x.shape, z.shape, w.shape, out.shape)
    entry = f"gated_rms_norm_{_cuda.dtype_tag(w)}"
    args = _cuda.bind(ARGS[entry], x=x, z=z, w=w, y=out, R=R, D=D, eps=eps)
    _cuda.launch(_cuda.kernel("gated_rms_norm", entry), (R,), (_cuda.threads(D, 512),), args)
    return out
