"""Residual add fused with RMSNorm: x += residual, then out = rms_norm(x); pairs: cuda/rms_norm.cu
(entries add_rms_norm_*), tests/kernels/test_gpu_add_rms_norm.py. Not wired into the models yet.

Non-finite inputs (cpu and gpu follow ``ref``): the add is numpy's (inf + -inf is NaN) and x keeps
it; then each row of the sum is normed by its mean square. A NaN in the row makes every output
NaN (so does a row of -inf: inf / inf). Otherwise an inf of either sign, or a square that
overflows fp32 (|x| above ~1.8e19), makes the mean square inf: the row's finite entries give 0
and its infinite ones NaN.
"""
import numpy as np

from freetoken.kernels import rms_norm


def ref(x, residual, w, eps, out=None):
    """x f32[R,H] (updated in place to x + residual), residual f32[R,H], w [H] (bf16 bits or
    float) -> rms_norm(x + residual) f32[R,H]. ``out`` must not be ``x``: x keeps the sum."""
    assert out is not x, "add_rms_norm: out must not alias x"
    x += np.asarray(residual, np.float32)
    return rms_norm.ref(x, w, eps, out)


def cpu(x, residual, w, eps, out=None):
    """Same contract as ``ref``: numpy add in place, then the numba row norm."""
    assert out is not x, "add_rms_norm: out must not alias x"
    np.add(x, residual, out=x)
    return rms_norm.cpu(x, w, eps, out)


ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "add_rms_norm_bf16": ("x:f32*", "residual:f32*", "w:u16*", "y:f32*", "R:i32", "H:i32",
                          "eps:f32"),
    "add_rms_norm_f32": ("x:f32*", "residual:f32*", "w:f32*", "y:f32*", "R:i32", "H:i32",
                         "eps:f32"),
}


def gpu(x, residual, w, eps, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[R,H] is required, distinct from x."""
    from freetoken.kernels import _cuda
    R, H = x.shape
    assert residual.shape == out.shape == (R, H) and w.shape == (H,), \
        (x.shape, residual.shape, w.shape, out.shape)
    assert out is not x, "add_rms_norm: out must not alias x"
    entry = f"add_rms_norm_{_cuda.dtype_tag(w)}"
    args = _cuda.bind(ARGS[entry], x=x, residual=residual, w=w, y=out, R=R, H=H, eps=eps)
    _cuda.launch(_cuda.kernel("rms_norm", entry), (R,), (_cuda.threads(H, 512),), args)
    return out
