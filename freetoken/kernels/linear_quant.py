"""The linear op (kernels/linear.py's contract) over a quantized weight: w as a GGUF file stores
it (kernels/qblocks.py), [M, K/V, B], read block by block. The spec is linear.ref on the weight
dequantized by qblocks.dequantize_ref; the numba GEMV sums in another order (within fp32
rounding). With int8 dots (kernels/qact.py) x is rounded first, once per call, inside the
kernel, and every row dot is an int8 one. Many tokens (prefill) with int8 dots on a CPU with
VNNI: ``gemm``, the int8 tile GEMM (kernels/qgemm.py); otherwise linear._blas, which dequantizes
blocks of rows into a pool thread's scratch (`dequant_rows`) for BLAS, as it widens bf16.

Shape legend: T tokens, K inputs, M outputs (weight rows), V values per block, B block bytes.
"""
import numpy as np

from freetoken.kernels import qgemm
from freetoken.kernels._numba import HOT, SERIAL, njit, prange
from freetoken.kernels.qact import prepared, quantize, rows_dot_tokens, wants_int8
from freetoken.kernels.qblocks import dequant_row
from freetoken.kernels.qformats import format_of, logical_shape
from freetoken.kernels.qinterleave import dequant_groups, require_int8, rows_per

ROWS = 16            # weight rows per parallel work item
GEMM_MIN_T = 8       # tokens from which the tile GEMM beats the GEMV (q4_k 1024 x 1024, 2-core
                     # Xeon, GEMV / GEMM time: 0.62 at 4 tokens, 1.21 at 8, 1.95 at 16)


@njit(**HOT)
def _gemv(x, w, code, int8, out):
    """out[t, m] = row m . x[t] (rounded first when int8), in work items of ROWS rows
    (qact.rows_dot_tokens: a few tokens re-read an item's rows from L1)."""
    xa = prepared(x, code, int8)
    M, T = w.shape[0] * rows_per(code), x.shape[0]
    toks = np.arange(T)
    for item in prange((M + ROWS - 1) // ROWS):
        rows_dot_tokens(w, code, int8, xa, toks, 0, T, item * ROWS, min(item * ROWS + ROWS, M), out, False)


@njit(**HOT)
def _gemv_pair(x, w0, c0, int8_0, w1, c1, int8_1, out):
    """_gemv over two weights of different formats stacked along M (w0's rows first): one call
    a step where there were two, each part's x prepared once."""
    xa0, xa1 = prepared(x, c0, int8_0), prepared(x, c1, int8_1)
    M0, M1, T = w0.shape[0] * rows_per(c0), w1.shape[0] * rows_per(c1), x.shape[0]
    toks, out1 = np.arange(T), out[:, M0:]
    for item in prange((M0 + ROWS - 1) // ROWS):       # two loops as _gemv's: one format each
        rows_dot_tokens(w0, c0, int8_0, xa0, toks, 0, T, item * ROWS, min(item * ROWS + ROWS, M0), out, False)
    for item in prange((M1 + ROWS - 1) // ROWS):
        rows_dot_tokens(w1, c1, int8_1, xa1, toks, 0, T, item * ROWS, min(item * ROWS + ROWS, M1), out1, False)


@njit(**SERIAL)
def _dequant_rows(w, code, out):
    for r in range(w.shape[0]):
        dequant_row(w[r], code, out[r])


def dequant_rows(w, out):
    """Quantized rows w [R, K/V, B] (or interleaved, [R/16, K/32, 288]) into out f32[R, K] (a
    pool thread's scratch, one thread)."""
    if format_of(w).rows > 1:
        dequant_groups(np.ascontiguousarray(w), out)
    else:
        _dequant_rows(np.ascontiguousarray(w), format_of(w).code, out)
    return out


def gemv(x, w, out, dots="f32"):
    """x f32[T,K] (few tokens), w [M,K/V,B] -> out f32[T,M]; dots: as qact.wants_int8."""
    int8 = wants_int8(w, dots)
    require_int8(w, int8)
    _gemv(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w), format_of(w).code, int8, out)
    return out


def gemv_pair(x, parts, out, dots="f32"):
    """gemv over a tuple of two quantized parts (a GGUF q|k and v of different formats) in one
    call; out f32[T, M0 + M1] (made when None)."""
    w0, w1 = (np.ascontiguousarray(p) for p in parts)
    for w in (w0, w1):
        require_int8(w, wants_int8(w, dots))
    if out is None:
        out = np.empty((x.shape[0], logical_shape(w0)[0] + logical_shape(w1)[0]), np.float32)
    _gemv_pair(np.ascontiguousarray(x, np.float32), w0, format_of(w0).code, wants_int8(w0, dots),
               w1, format_of(w1).code, wants_int8(w1, dots), out)
    return out


def uses_gemm(w, dots) -> bool:
    """Whether many tokens go through ``gemm`` (as experts_quant.uses_gemm)."""
    return wants_int8(w, dots) and qgemm.supported(w) and qgemm.fast_here()


def gemm(x, w, out):
    """x f32[T,K] (many tokens), w [M,K/V,B] -> out f32[T,M] by the int8 tile GEMM: x rounded."""
    q, d, _ = quantize(x)
    T = x.shape[0]
    offs = np.array([0, T], np.int32)
    src, first = qgemm.lane_sources(offs, np.arange(T, dtype=np.int32))
    t = qgemm.tiles(q, d, src, format_of(w).code)
    return qgemm.gemm(np.ascontiguousarray(w)[None], t, np.zeros(1, np.int32), offs, first, out, False)
