"""x * sigmoid(gate): gated attention's output gate (gate [R,D], a full gate per element) and the
shared expert's gate (gate [R,1], one scalar per row broadcast over it); pairs:
cuda/sigmoid_mul.cu, tests/kernels/test_sigmoid_mul.py."""
import numpy as np


def ref(x, gate, out=None):
    """x f32[R,D], gate f32[R,D] or f32[R,1] -> f32[R,D], fp32."""
    x = np.asarray(x, np.float32)
    gate = np.asarray(gate, np.float32)
    assert gate.shape in (x.shape, (x.shape[0], 1)), (x.shape, gate.shape)
    with np.errstate(over="ignore"):               # exp(-g) -> inf for g << 0: sigmoid -> 0
        res = x * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))
    if out is None:
        return res
    out[...] = res
    return out
