"""Dense projection out = x @ w.T, fp32 accumulate; pairs: cuda/linear.cu,
tests/kernels/test_linear.py, bench/kernels/experts_cpu.py (its linear rows)."""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._simd import prefetch_ahead
from freetoken.kernels import linear_quant
from freetoken.kernels.qact import rounded, rounded_ref, wants_int8
from freetoken.kernels.qformats import dequantize_ref, is_quantized, logical_shape
from freetoken.kernels.qinterleave import require_int8, row_range
from freetoken.kernels._blas_pool import run_items, workers
from freetoken.kernels._numba import (HOT, SERIAL, dot, dots, from_bits, njit, prange, split_x,
                                      weight_rows)

ROWS = 32              # weight rows per parallel work item (a multiple of 4: see dot_rows4)
BLAS_MIN_T = 32        # from this many tokens, widened fp32 blocks + BLAS beat the row GEMV
BLOCK_BYTES = 4 << 20  # fp32 bytes of one widened weight block: stays in the last-level cache


def ref(x, w, out=None, *, dots="f32"):
    """x f32[T,K], w [M,K] (bf16 bits or float; quantized [M,K/V,B], kernels/qblocks.py; or a
    tuple of such parts stacked along M, GGUF q/k/v of different formats) -> f32[T,M].
    dots="int8": x rounded as the int8 dots round it (kernels/qact.py) for a quantized w whose
    format has them."""
    if isinstance(w, tuple):
        return _parts(ref, x, w, out, dots)
    x = np.asarray(x, np.float32)
    x = rounded_ref(x) if wants_int8(w, dots) else x
    res = x @ (dequantize_ref(w) if is_quantized(w) else to_f32(w)).T
    if out is None:
        return res
    out[...] = res
    return out


@njit(**HOT)
def _gemv(xs, w, toks, out):
    """out[t, m] = dot(xs[t], w[m]); parallel over blocks of ROWS weight rows, each row read once
    for all T tokens. xs f32[T,L,K/L], w [M,K/L] in the row-dot layouts of _numba; toks = 0..T-1.
    (No numpy calls outside the prange: under parallel=True each becomes a parfor to compile.)"""
    T = xs.shape[0]
    M = w.shape[0]
    for b in prange((M + ROWS - 1) // ROWS):
        r = np.empty(T, np.float32)
        for m in range(b * ROWS, min(b * ROWS + ROWS, M)):
            dots(xs, toks, w[m], r)
            for t in range(T):
                out[t, m] = r[t]


# ---- single-token row dots over several memory streams -----------------------------------------
# One token's GEMV is a pure weight stream. Reading one row per loop (dots/dot) left a core at about
# 65% of its read bandwidth on the 2-core dev box; reading 2-4 rows in one loop, each far from the
# others (different 4 KiB pages), keeps more misses in flight: +25-55% per thread (measured with
# bench-like shapes, H 1024, bf16). Rows next to each other in one loop were 2x slower, so the
# rows of a block of ROWS are taken ROWS/4 apart. bf16-pair rows only (the layouts of _numba).

@njit(inline="always", **SERIAL)
def dot_rows2(xs, w, r0, r1):
    """(dot(xs, w[r0]), dot(xs, w[r1])) for bf16-pair rows w u32[M,K/2] and one activation xs
    f32[2,K/2]; the rows ahead of both asked for (prefetch_ahead)."""
    prefetch_ahead(w, r0)
    prefetch_ahead(w, r1)
    w0, w1 = w[r0], w[r1]
    xe, xo = xs[0], xs[1]
    a0 = b0 = a1 = b1 = np.float32(0.0)
    for i in range(w0.shape[0]):
        p, q = w0[i], w1[i]
        a0 += xe[i] * from_bits(p << np.uint32(16))
        b0 += xo[i] * from_bits(p & np.uint32(0xFFFF0000))
        a1 += xe[i] * from_bits(q << np.uint32(16))
        b1 += xo[i] * from_bits(q & np.uint32(0xFFFF0000))
    return a0 + b0, a1 + b1


@njit(inline="always", **SERIAL)
def dot_rows4(xs, w0, w1, w2, w3):
    """Four rows at once, as dot_rows2."""
    xe, xo = xs[0], xs[1]
    a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = np.float32(0.0)
    for i in range(w0.shape[0]):
        p, q, r, s = w0[i], w1[i], w2[i], w3[i]
        e, o = xe[i], xo[i]
        a0 += e * from_bits(p << np.uint32(16))
        b0 += o * from_bits(p & np.uint32(0xFFFF0000))
        a1 += e * from_bits(q << np.uint32(16))
        b1 += o * from_bits(q & np.uint32(0xFFFF0000))
        a2 += e * from_bits(r << np.uint32(16))
        b2 += o * from_bits(r & np.uint32(0xFFFF0000))
        a3 += e * from_bits(s << np.uint32(16))
        b3 += o * from_bits(s & np.uint32(0xFFFF0000))
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@njit(inline="always", **SERIAL)
def rows_block4(xt, w, r0, r1, out):
    """out[r] = dot(xt, w[r]) for r in [r0, r1): a full block of ROWS rows as four streams ROWS/4
    rows apart, a partial block row by row. xt f32[2,K/2], w u32[M,K/2], out f32[M] (any strides)."""
    if r1 - r0 == ROWS:
        q = ROWS // 4
        for r in range(r0, r0 + q):
            for stream in range(4):
                prefetch_ahead(w, r + stream * q)
            out[r], out[r + q], out[r + 2 * q], out[r + 3 * q] = dot_rows4(
                xt, w[r], w[r + q], w[r + 2 * q], w[r + 3 * q])
    else:
        for r in range(r0, r1):
            prefetch_ahead(w, r)
            out[r] = dot(xt, w[r])


@njit(**SERIAL)
def split_pairs(x):
    """x f32[T,K] -> f32[T,2,K/2], the activation layout of bf16-pair rows (_numba.split_x), in
    numba: for the decode calls that run several kernels in one (kernels/decode_layer.py)."""
    T, K = x.shape
    xs = np.empty((T, 2, K // 2), np.float32)
    for t in range(T):
        for i in range(K // 2):
            xs[t, 0, i] = x[t, 2 * i]
            xs[t, 1, i] = x[t, 2 * i + 1]
    return xs


@njit(**HOT)
def _gemv_pairs(xs, w, toks, out):
    """_gemv for bf16-pair rows (w u32[M,K/2], xs f32[T,2,K/2]): tokens in fours share each row
    (dots); the T % 4 left over read their rows as four streams (rows_block4)."""
    T = xs.shape[0]
    M = w.shape[0]
    T4 = T // 4 * 4
    for b in prange((M + ROWS - 1) // ROWS):
        m0, m1 = b * ROWS, min(b * ROWS + ROWS, M)
        if T4:
            r = np.empty(T4, np.float32)
            for m in range(m0, m1):
                dots(xs, toks[:T4], w[m], r)
                for t in range(T4):
                    out[t, m] = r[t]
        for t in range(T4, T):
            rows_block4(xs[t], w, m0, m1, out[t])


def widen_rows(w, buf):
    """buf f32[R,K] = bf16 bits w [R,K] (numpy, one thread: inside numba's pool the widening
    and BLAS's own thread pool would take turns spinning on the same cores)."""
    np.left_shift(w, 16, out=buf.view(np.uint32), dtype=np.uint32)
    return buf


def _rows_f32(w, buf):
    if is_quantized(w):
        return linear_quant.dequant_rows(w, buf)
    return widen_rows(w, buf)


def _parts(op, x, parts: tuple, out, dots):
    """op over each part of a weight stacked along M, into its columns of out f32[T, sum M]."""
    sizes = [logical_shape(p)[0] for p in parts]
    if out is None:
        out = np.empty((np.asarray(x).shape[0], sum(sizes)), np.float32)
    at = 0
    for part, m in zip(parts, sizes):
        out[:, at:at + m] = op(x, part, dots=dots)
        at += m
    return out


def _blas(x, w, out):
    """Many tokens: blocks of weight rows, one per pool thread at a time, each widened to fp32
    (at most BLOCK_BYTES, so it stays in cache) and multiplied by a single-threaded BLAS call.
    At least two blocks per thread, so a thread that started late still gets its share."""
    M, K = logical_shape(w)
    rows = min(BLOCK_BYTES // (4 * K), -(-M // (2 * workers())))
    rows = max(16, -(-rows // 16) * 16)

    def scratch():
        return None if w.dtype == np.float32 else np.empty((rows, K), np.float32)

    def block(m0, buf):
        m1 = min(M, m0 + rows)
        wf = w[m0:m1] if buf is None else _rows_f32(row_range(w, m0, m1), buf[:m1 - m0])
        np.matmul(x, wf.T, out=out[:, m0:m1])

    run_items(range(0, M, rows), block, scratch)
    return out


def cpu(x, w, out=None, *, dots="f32"):
    """Same contract as ``ref``: numba row GEMV for few tokens (decode), BLAS for many; a
    quantized w with int8 dots on VNNI: the int8 tile GEMM from GEMM_MIN_T tokens (linear_quant)."""
    if isinstance(w, tuple):
        if len(w) == 2 and all(map(is_quantized, w)) and np.shape(x)[0] < linear_quant.GEMM_MIN_T:
            return linear_quant.gemv_pair(x, w, out, dots)      # decode: one call, not two
        return _parts(cpu, x, w, out, dots)
    x = np.ascontiguousarray(x, np.float32)
    T, K = x.shape
    M, Kw = logical_shape(w)
    assert Kw == K, (x.shape, w.shape)
    w = np.ascontiguousarray(w)
    if out is None:
        out = np.empty((T, M), np.float32)
    if is_quantized(w):
        require_int8(w, wants_int8(w, dots))            # an interleaved q4_0 (kernels/qinterleave.py)
        if T >= linear_quant.GEMM_MIN_T and linear_quant.uses_gemm(w, dots):
            return linear_quant.gemm(x, w, out)
        if T < BLAS_MIN_T:
            return linear_quant.gemv(x, w, out, dots)
    if T >= BLAS_MIN_T:
        return _blas(rounded(x) if wants_int8(w, dots) else x, w, out)
    rows = weight_rows(w)
    gemv = _gemv_pairs if rows.dtype == np.uint32 else _gemv
    gemv(split_x(x, rows), rows, np.arange(T, dtype=np.int32), out)
    return out


# --- gpu (cuda/linear.cu) -----------------------------------------------------------------------

GEMV_MAX_T = 8  # linear_gemv has unrolled instances for 1..8 tokens; more take the tiled GEMM
ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    f"linear_{algo}_{tag}": ("x:f32*", f"w:{w}", "y:f32*", "T:i32", "K:i32", "M:i32", "ldy:i32")
    for algo in ("gemv", "gemm")
    for tag, w in (("bf16", "u16*"), ("f32", "f32*"), ("q", "u8*"))   # q: cuda/linear_quant.cu
}


def gpu(x, w, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,M] is required. T <= 8 (decode,
    lm_head): a warp per weight row, read once for all tokens. More: 64x64 shared-memory tiles
    with fp32 FMA, so activations are never rounded to bf16 (ref's numerics, not cuBLAS's).
    A quantized w is read in its blocks (cuda/linear_quant.cu, one module per format); a tuple
    of parts writes each part's columns of out."""
    from freetoken.kernels import _cuda
    T, K = x.shape
    M = sum(logical_shape(p)[0] for p in w) if isinstance(w, tuple) else logical_shape(w)[0]
    assert out.shape == (T, M), (x.shape, out.shape)
    if T == 0:
        return out
    parts = w if isinstance(w, tuple) else (w,)
    assert out.flags.c_contiguous, out.strides    # each part writes rows T apart by M (ldy)
    at = 0
    for part in parts:
        m = logical_shape(part)[0]
        assert logical_shape(part) == (m, K), (x.shape, part.shape)
        y = out if len(parts) == 1 else _cuda.flat_span(out[:, at:at + m])
        _launch(_cuda, x, part, y, T, K, m, M)
        at += m
    return out


def _launch(_cuda, x, w, y, T, K, M, ldy):
    gemv = T <= GEMV_MAX_T
    algo = "gemv" if gemv else "gemm"
    if is_quantized(w):
        entry, kern = f"linear_{algo}_q", ("linear_quant", f"linear_{algo}_q", _cuda.quant_defines(w))
    else:
        entry = f"linear_{algo}_{_cuda.dtype_tag(w)}"
        kern = ("linear", entry)
    args = _cuda.bind(ARGS[entry], x=x, w=w, y=y, T=T, K=K, M=M, ldy=ldy)
    grid = (-(-M // 4),) if gemv else (-(-M // 64), -(-T // 64))
    _cuda.launch(_cuda.kernel(*kern), grid, (128 if gemv else 256,), args)
