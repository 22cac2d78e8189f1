"""sigmoid and silu for the numba kernels (gdn_conv, gated_rms_norm, sigmoid_mul), both built on
logprobs' ``_exp_neg``, the Cephes expf of x <= 0 that LLVM vectorizes: np.exp compiles to one
libm call per element, ~3 ns each on the dev box, which was 80% of a decode-sized gdn_conv.

exp is only ever taken of -|a|, in (0, 1], so nothing overflows for any finite a (fastmath
assumes no infinities). a <= -87 gives sigmoid 0 where float32 could hold down to 1e-38: far
under any tolerance of the ops that use it. Callers compile with error_model="numpy": numba's
default checks every division for zero, and that branch keeps the loop from vectorizing (a
32768-element silu: 160 us checked, 10 us unchecked on the dev box)."""
import numpy as np

from freetoken.kernels._numba import njit
from freetoken.kernels.logprobs import _exp_neg

_ONE = np.float32(1.0)


@njit(inline="always")
def sigmoid(a):
    """1 / (1 + exp(-a)) in float32 as e^a/(1+e^a) for a < 0, so exp never sees a positive."""
    e = _exp_neg(-abs(a))
    s = _ONE / (_ONE + e)
    return s if a >= 0 else e * s


@njit(inline="always")
def silu(a):
    """a * sigmoid(a)."""
    return a * sigmoid(a)


@njit(fastmath=True, cache=True, nogil=True)
def silu_mul(g, u):
    """silu(g) * u of the experts ops (experts, experts_quant) with np.exp: their numbers since
    before the vectorizing exp, which their per-row loops would not gain from. The clamp keeps
    exp finite: fastmath assumes no infinities."""
    return g / (_ONE + np.exp(min(-g, np.float32(80.0)))) * u
