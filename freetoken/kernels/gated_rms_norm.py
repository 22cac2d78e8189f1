"""Gated RMSNorm, the Gated DeltaNet output norm: x * rsqrt(mean(x^2) + eps) * w * silu(z) over
the last axis (per value head: R = T*Hv rows of D = Dv); pairs: cuda/gated_rms_norm.cu,
tests/kernels/test_gated_rms_norm.py. The weight is used as stored (no 1+w, unlike the
model's other norms)."""
import numpy as np

from freetoken.kernels._bf16 import to_f32


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
