"""Activations rounded to 8 bits per 32 values: what the int8 row dots of quantized weights read
(kernels/_simd.py's ``idot_*``), the way llama.cpp's CPU path computes a GGUF file's dots.

The rounding (``quantize_ref``, the spec; ``quantize`` here is bit-exact with it): for each 32
consecutive values x of a row, in fp32,
    d = max|x| / 127,   inv = 1 / d (0 when d is 0),   q = rint(x * inv) in [-127, 127] (int8)
so the row stands for q * d. An int8 dot of a weight row w with it is then the spec's
dot(dequantize(w), q * d): the sums over each 32 values are exact integers, each scaled once.
``s`` = d * sum(q) per 32 values (fp32) rides along: the K-quants' block minimums, q4_1's and
q5_1's mins and q4_0's and q5_0's offsets are applied through it.

Which ops round: with ``dots="int8"`` (the engine's --cpu-dots, bound by backend.get_ops), the
CPU ``linear`` and ``experts`` ops (cpu and ref: ref applies the same rounding, so it stays the
spec) round their input before each weight whose format has int8 dots (``wants_int8``); the
experts round the activation between gate_up and down too. The GEMVs then run the int8 dots, the
BLAS path multiplies by the rounded values (``rounded``): one result, within fp32 rounding.

Shape legend: T rows (tokens), K values per row (a multiple of 32), K/32 the groups.
"""
import numpy as np

from freetoken.kernels._numba import SERIAL, from_bits, njit, prange, to_bits
from freetoken.kernels._simd import (idot_mxfp4, idot_q2_k, idot_q3_k, idot_q4_0, idot_q4_0x16, idot_q4_1, idot_q4_k,
                                     idot_q5_0, idot_q5_1, idot_q5_k, idot_q6_k, idot_q8_0, prefetch_ahead)
from freetoken.kernels.qblocks import check_code, dot_row, values_of
from freetoken.kernels.qformats import format_named, format_of, is_quantized

DOTS = ("int8", "f32")         # the choices of --cpu-dots

GROUP = 32                     # values that share one scale
# without fastmath: the fp32 divisions and rint must be those of numpy (bit-exact with the ref).
# Said explicitly: numba compiles a callee that leaves fastmath unset with its caller's, and the
# GEMV kernels (fastmath) call `prepared` (a division by 127 became a multiply: 1 ulp off)
EXACT = dict(cache=True, nogil=True, fastmath=False)


def quantize_ref(x):
    """x f32[T,K] -> (q int8[T,K], d f32[T,K/32], s f32[T,K/32]), numpy, the spec."""
    x = np.asarray(x, np.float32)
    g = x.reshape(x.shape[0], -1, GROUP)
    d = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(g * inv[:, :, None]), -127, 127).astype(np.int8)
    s = (d * q.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(x.shape), d, s


def dequantize_ref(q, d):
    """The values q * d the int8 dots multiply by, f32[T,K]."""
    g = q.reshape(q.shape[0], -1, GROUP).astype(np.float32) * d[:, :, None]
    return g.reshape(q.shape)


# the group's sum of quants may be added in any order (32 integers within +-127: every partial sum
# is exact in fp32), so "reassoc" alone, which lets it vectorize and changes no other operation
SUM_IN_ANY_ORDER = dict(EXACT, fastmath={"reassoc"})


@njit(**SUM_IN_ANY_ORDER)
def _quantize_group(x, q, d, s, t, g):
    """Group g of row t. max|x| is taken on the bits (sign cleared): for non-negative floats
    their order, so the same maximum, and an integer max vectorizes where a float one without
    fastmath does not (a NaN's bits are above inf's, so NaN wins as in numpy). Row views: the
    2-D indexing compiled to gathers."""
    xs, qs = x[t, g * GROUP:g * GROUP + GROUP], q[t, g * GROUP:g * GROUP + GROUP]
    top = np.uint32(0)
    for i in range(GROUP):
        top = max(top, np.uint32(to_bits(xs[i]) & np.uint32(0x7FFFFFFF)))
    dg = from_bits(top) / np.float32(127.0)
    inv = np.float32(1.0) / dg if dg > 0 else np.float32(0.0)
    total = np.float32(0.0)
    for i in range(GROUP):
        v = min(max(np.rint(xs[i] * inv), np.float32(-127.0)), np.float32(127.0))
        qs[i] = np.int8(np.int32(v))
        total += v
    d[t, g] = dg
    s[t, g] = dg * total


@njit(parallel=True, **EXACT)
def _quantize_many(x, q, d, s):
    for t in prange(x.shape[0]):
        for g in range(x.shape[1] // GROUP):
            _quantize_group(x, q, d, s, t, g)


@njit(**EXACT)
def _quantize_few(x, q, d, s):
    for t in range(x.shape[0]):
        for g in range(x.shape[1] // GROUP):
            _quantize_group(x, q, d, s, t, g)


def quantize(x, parallel=None):
    """quantize_ref's result, numba; parallel over rows unless told (default: from 9 rows: a
    parallel region costs more than a few; a pool thread's caller says False)."""
    x = np.ascontiguousarray(x, np.float32)
    T, K = x.shape
    if K % GROUP:
        raise ValueError(f"int8 activations need a multiple of {GROUP} values per row, got {K}")
    q = np.empty((T, K), np.int8)
    d, s = np.empty((T, K // GROUP), np.float32), np.empty((T, K // GROUP), np.float32)
    (_quantize_many if (T > 8 if parallel is None else parallel) else _quantize_few)(x, q, d, s)
    return q, d, s


def wants_int8(w, dots) -> bool:
    """Whether an op in mode ``dots`` rounds its input before the weight w (a quantized format
    with int8 dots)."""
    if dots not in DOTS:
        raise ValueError(f"dots must be one of {DOTS}, got {dots!r}")
    return dots == "int8" and is_quantized(w) and format_of(w).int8_dots


def rounded_ref(x):
    """x f32[T,K] as the int8 dots see it: dequantize_ref(quantize_ref(x)) (the spec)."""
    q, d, _ = quantize_ref(x)
    return dequantize_ref(q, d)


def rounded(x, parallel=None):
    """rounded_ref(x), numba's rounding (the BLAS path's input in int8 mode)."""
    q, d, _ = quantize(x, parallel)
    return dequantize_ref(q, d)


# the formats whose xs are per 16 values (sums16)
Q2_K, Q3_K, Q6_K, Q4_0X16 = (format_named(name).code for name in ("q2_k", "q3_k", "q6_k", "q4_0x16"))


@njit(inline="always", **EXACT)
def per16(code):
    """Whether format ``code``'s scales, so the xs its int8 dot reads, are per 16 values."""
    return code == Q2_K or code == Q3_K or code == Q6_K


@njit(**EXACT)
def sums16(q, d):
    """The xs of q2_k, q3_k and q6_k: f32[T,K/16] = d of the group * the sum of each 16 values
    of q i8[T,K] (their scales and mins are per 16 values; with these sums a row dot takes the
    quants' offset or the mins off once per group instead of running a second integer dot)."""
    T, K = q.shape
    out = np.empty((T, K // 16), np.float32)
    for t in range(T):
        for i in range(K // 16):
            total = 0
            for v in range(16 * i, 16 * i + 16):
                total += np.int32(q[t, v])
            out[t, i] = d[t, i // 2] * np.float32(total)
    return out


@njit(**EXACT)
def prepared(x, code, int8):
    """The tokens a GEMV kernel over weights of format ``code`` reads through ``dot_token``, made
    inside the kernel (a numba call and three numpy allocations from Python cost more than this
    at decode): (x f32[T,K], xq i8[T,K/V,V], xd f32[T,K/V,V/32], xs f32[T,K/V,V/32], for a
    per16 format [T,K/V,V/16]: sums16), x rounded in blocks of V values when int8, else
    empty arrays (one compiled kernel serves both). Compiled without fastmath, as quantize_ref
    rounds."""
    T, K = x.shape
    values = values_of(code)
    nb = K // values
    if int8:
        q = np.empty((T, K), np.int8)
        d, s = np.empty((T, K // GROUP), np.float32), np.empty((T, K // GROUP), np.float32)
        _quantize_few(x, q, d, s)
        per_s = 16 if per16(code) else GROUP
        s = sums16(q, d) if per16(code) else s
        return x, q.reshape((T, nb, values)), d.reshape((T, nb, values // GROUP)), s.reshape((T, nb, values // per_s))
    return x, np.empty((0, 0, 0), np.int8), np.empty((0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32)


@njit(inline="always", **SERIAL)
def dot_token(row, code, xa, t, int8):
    """row . token t of xa = prepared(x, code, int8): the int8 dot of its rounded values (the row's
    format has them: wants_int8), or dot_row."""
    if int8:
        return idot_blocks(row, code, xa[1][t], xa[2][t], xa[3][t])
    return dot_row(row, code, xa[0][t])


@njit(inline="always", **SERIAL)
def rows_dot_tokens(w, code, int8, xa, toks, p0, p1, r0, r1, out, by_row):
    """Rows r0..r1-1 of w [R, K/V, B] against p0..p1-1, entry p reading token toks[p] of xa
    (prepared): out[p, r], or out[r, p] when by_row (the quantized GEMVs' work item). With int8
    dots an entry's rounded blocks (three array views) are taken once for all the rows: taken per
    row, as dot_token does, the expert decode calls ran 4-12% slower (T=1, 64 experts top 8, Zen
    4); otherwise each row is read once for all entries."""
    if int8 and code == Q4_0X16:
        _groups_dot_tokens(w, xa, toks, p0, p1, r0, r1, out, by_row)
    elif int8:
        for p in range(p0, p1):
            t = toks[p]
            xq, xd, xs = xa[1][t], xa[2][t], xa[3][t]
            for r in range(r0, r1):
                if p == p0:
                    prefetch_ahead(w, r)
                v = idot_blocks(w[r], code, xq, xd, xs)
                if by_row:
                    out[r, p] = v
                else:
                    out[p, r] = v
    else:
        for r in range(r0, r1):
            row = w[r]
            prefetch_ahead(w, r)
            for p in range(p0, p1):
                v = dot_token(row, code, xa, toks[p], int8)
                if by_row:
                    out[r, p] = v
                else:
                    out[p, r] = v


@njit(inline="always", **SERIAL)
def _groups_dot_tokens(w, xa, toks, p0, p1, r0, r1, out, by_row):
    """rows_dot_tokens over an interleaved q4_0 weight w u8[R/16, NB, 288] (kernels/qinterleave.py):
    16 rows a dot; r0 and r1 multiples of 16 (the callers' work items are)."""
    for p in range(p0, p1):
        t = toks[p]
        xq, xd, xs = xa[1][t], xa[2][t], xa[3][t]
        for g in range(r0 // 16, r1 // 16):
            if p == p0:
                prefetch_ahead(w, g)
            if by_row:
                idot_q4_0x16(w[g], xq, xd, xs, out[16 * g:16 * g + 16, p])
            else:
                idot_q4_0x16(w[g], xq, xd, xs, out[p, 16 * g:16 * g + 16])


# ---- the int8 row dots: a row in its blocks against the rounded x, exact integer sums ---------

@njit(inline="always", **SERIAL)
def idot_blocks(row, code, xq, xd, xs):
    """idot_row with the rounded x already in blocks (xq i8[NB,V], xd, xs f32[NB,V/32]; a per16
    format's xs f32[NB,V/16], sums16) and the code checked by the caller (dot_token: a reshape per
    row costs as much as a short dot)."""
    if code == 4:
        return idot_q8_0(row, xq, xd, xs)
    if code == 7:
        return idot_q4_k(row, xq, xd, xs)
    if code == 8:
        return idot_q5_k(row, xq, xd, xs)
    if code == 11:
        return idot_mxfp4(row, xq, xd, xs)
    if code == 9:
        return idot_q6_k(row, xq, xd, xs)
    return _idot_low(row, code, xq, xd, xs)


@njit(inline="always", **SERIAL)
def _idot_low(row, code, xq, xd, xs):
    """idot_blocks of the low-bit and legacy formats (kernels/_simd_int8_low.py)."""
    if code == 0:
        return idot_q4_0(row, xq, xd, xs)
    if code == 1:
        return idot_q4_1(row, xq, xd, xs)
    if code == 2:
        return idot_q5_0(row, xq, xd, xs)
    if code == 3:
        return idot_q5_1(row, xq, xd, xs)
    if code == 5:
        return idot_q2_k(row, xq, xd, xs)
    return idot_q3_k(row, xq, xd, xs)


@njit(**SERIAL)
def idot_row(row, code, xq, xd, xs):
    """qblocks.dot_row of the rounded x (xq i8[K], xd and xs f32[K/32], C-contiguous: quantize's
    output; a per16 format makes its own xs, sums16) for the formats with int8 dots
    (qformats.QuantFormat.int8_dots: every GGUF block format)."""
    check_code(code, row.shape[1])
    if code == 10:
        raise ValueError("no int8 dot for this quantized format")
    nb, v = row.shape[0], values_of(code)
    xs_blocks = (sums16(xq.reshape(1, nb * v), xd.reshape(1, nb * v // 32)).reshape(nb, v // 16)
                 if per16(code) else xs.reshape(nb, v // 32))
    return idot_blocks(row, code, xq.reshape(nb, v), xd.reshape(nb, v // 32), xs_blocks)
