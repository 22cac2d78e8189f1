"""x * sigmoid(gate): gated attention's output gate (gate [R,D], a full gate per element) and the
shared expert's gate (gate [R,1], one scalar per row broadcast over it); pairs:
cuda/sigmoid_mul.cu, tests/kernels/test_sigmoid_mul.py."""
import numpy as np

from freetoken.kernels._activations import sigmoid
from freetoken.kernels._numba import HOT, SERIAL, njit, prange


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


# --- cpu: numba (numpy's exp is SIMD too, but ref makes three temporaries and four passes) ---

ROWS = 16  # rows per parallel work item
PARALLEL_MIN = 1 << 18  # R*D from which the parallel driver runs (64 tokens of 4096)


@njit(**SERIAL)
def _rows(x, gate, out, r0, r1):
    D = x.shape[1]
    for r in range(r0, r1):
        if gate.shape[1] != 1:
            for i in range(D):
                out[r, i] = x[r, i] * sigmoid(gate[r, i])
        else:
            s = sigmoid(gate[r, 0])
            for i in range(D):
                out[r, i] = x[r, i] * s


# decode (a few rows, ~8 us) runs serially: a parallel region costs about as much and, on a
# loaded machine, waits milliseconds for a descheduled worker; a prefill runs in parallel
@njit(**HOT)
def _rows_parallel(x, gate, out):
    R = x.shape[0]
    for q in prange((R + ROWS - 1) // ROWS):
        _rows(x, gate, out, q * ROWS, min(R, (q + 1) * ROWS))


def cpu(x, gate, out=None):
    """Same contract as ``ref``; ``out`` may be ``x`` (or a full ``gate``): element by element."""
    x = np.ascontiguousarray(x, np.float32)
    gate = np.ascontiguousarray(gate, np.float32)
    assert gate.shape in (x.shape, (x.shape[0], 1)), (x.shape, gate.shape)
    if out is None:
        out = np.empty_like(x)
    if x.size >= PARALLEL_MIN:
        _rows_parallel(x, gate, out)
    else:
        _rows(x, gate, out, 0, x.shape[0])
    return out


# --- gpu: cuda/sigmoid_mul.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "sigmoid_mul_f32": ("x:f32*", "gate:f32*", "y:f32*", "R:i32", "D:i32", "G:i32"),
}
THREADS = 256


def gpu(x, gate, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[R,D] is required and may be ``x``.
    One thread per element; G = gate's columns (D, or 1 for a per-row gate)."""
    from freetoken.kernels import _cuda
    R, D = x.shape
    assert gate.shape in ((R, D), (R, 1)) and out.shape == (R, D), (x.shape, gate.shape, out.shape)
    args = _cuda.bind(ARGS["sigmoid_mul_f32"], x=x, gate=gate, y=out, R=R, D=D, G=gate.shape[1])
    n = R * D
    block = _cuda.threads(n, THREADS)
    _cuda.launch(_cuda.kernel("sigmoid_mul", "sigmoid_mul_f32"), ((n + block - 1) // block,),
                 (block,), args)
    return out
