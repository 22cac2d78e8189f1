"""Quantized weight blocks (the format table and the spec: kernels/qformats.py): numba row kernels
that read the blocks as stored, for decode GEMVs straight from a GGUF file; Qwen's block FP8 too
(kernels/qfp8.py).

Shape legend (besides the kernels' own): a quantized weight is u8[..., R, NB, S]: R rows of NB
blocks of S bytes. S names the format (every supported one has its own block size), a block holds
V values (32; 256 for the K-quants), so a row holds K = NB*V values.

  dequant_row(row u8[NB,S], code, out f32[K])          bit-exact gguf-py ``dequantize``
  dot_row(row u8[NB,S], code, x f32[K]) -> f32          sum(dequant(row) * x), fp32 accumulation
  dot_rows(w u8[R,NB,S], code, x f32[K], out f32[R])    dot_row per row, parallel over rows

The int8 row dots (x rounded to 8 bits per 32 values, integer sums) are kernels/qact.py's.

``code`` is ``QuantFormat.code`` (an int, since numba kernels switch on it). Block layouts, in byte
offsets (d, dmin, m: fp16 scales; qs: packed low bits; qh: high bits; sc: sub-block scales):
  q4_0 d 0, qs 2 | q4_1 d 0, m 2, qs 4 | q5_0 d 0, qh 2 (u32), qs 6 | q5_1 d 0, m 2, qh 4, qs 8
  q8_0 d 0, qs 2 (i8) | q2_k sc 0, qs 16, d 80, dmin 82 | q3_k qh 0, qs 32, sc 96, d 108
  q4_k d 0, dmin 2, sc 4, qs 16 | q5_k d 0, dmin 2, sc 4, qh 16, qs 48
  q6_k qs 0 (low 4 bits), qh 128 (high 2), sc 192 (i8), d 208 | mxfp4 e 0 (e8m0), qs 1 (e2m1 nibbles;
  kernels/qmxfp4.py)
"""
import numpy as np

from freetoken.kernels._numba import HOT, SERIAL, from_bits, njit, prange
from freetoken.kernels._simd import dot_q4_k, dot_q5_k, dot_q6_k, dot_q8_0
from freetoken.kernels.qfp8 import dequant_fp8_row, dot_fp8_row
from freetoken.kernels.qmxfp4 import dequant_mxfp4_row, dot_mxfp4_row

# dequant_row reproduces gguf-py's float32 numpy arithmetic bit for bit, so it runs in gguf-py's
# order of ops and without fastmath, which may fuse d*q + m into one fma or reassociate (d*sc)*q.
# (Compiled with SERIAL it measured the same bits: every product here, fp16 d x 6-8 bit scale x
# 5-6 bit quant, is exact in fp32, so only the last add rounds either way; but fastmath also
# assumes no inf or nan, and exactness should not rest on that.) The dots keep SERIAL's fastmath:
# they are held to a tolerance.
EXACT = dict(cache=True, nogil=True)


# ---- block fields -------------------------------------------------------------------------------
# Numba types every integer operation as 64-bit; a quant is truncated to uint8 once built, so LLVM
# narrows the whole bit-extraction to bytes (else its vectors hold 8 int64 lanes, 2-3x slower).

@njit(inline="always", **EXACT)
def check_code(code, nbytes):
    """Raise unless ``code`` is a format whose blocks are ``nbytes`` long (the kernels read and
    write at offsets computed from ``code`` alone, unchecked)."""
    if code < 0 or code > 11 or nbytes != (18, 20, 22, 24, 34, 84, 110, 144, 176, 210, 132, 17)[code]:
        raise ValueError("quantized format code does not match the block size")


@njit(inline="always", **EXACT)
def values_of(code):
    """Values per block of format ``code`` (qformats.FORMATS; 12, LAYOUTS' q4_0x16, a q4_0 block per row)."""
    return 32 if code <= 4 or code >= 11 else (128 if code == 10 else 256)


@njit(inline="always", **EXACT)
def _f16(row, b, i):
    """The fp16 at bytes i, i+1 of block b, as float32 (exact, like numpy's astype)."""
    h = np.uint32(row[b, i]) | (np.uint32(row[b, i + 1]) << np.uint32(8))
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    if e == 0:  # zero or subnormal: m * 2**-24 (exact), built by arithmetic, not as fp32 bits
        v = np.float32(m) * np.float32(2.0 ** -24)
        return -v if sign else v
    if e == 31:  # inf, nan (payload kept)
        return from_bits(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return from_bits(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@njit(inline="always", **EXACT)
def _u32(row, b, i):
    """The little-endian uint32 at bytes i..i+3 of block b."""
    return (np.uint32(row[b, i]) | (np.uint32(row[b, i + 1]) << np.uint32(8))
            | (np.uint32(row[b, i + 2]) << np.uint32(16))
            | (np.uint32(row[b, i + 3]) << np.uint32(24)))


@njit(inline="always", **EXACT)
def _scale_min_k(row, b, j):
    """(scale, min) of sub-block j of a q4_k/q5_k block: 6-bit pairs packed in 12 bytes at 4
    (j < 4: low 6 bits of bytes j, j+4; else 4 bits of byte j+4 and the top 2 of bytes j-4, j)."""
    if j < 4:
        return np.int32(row[b, 4 + j] & 63), np.int32(row[b, 8 + j] & 63)
    lo = np.int32(row[b, 8 + j])
    return ((lo & 15) | ((np.int32(row[b, j]) >> 6) << 4),
            (lo >> 4) | ((np.int32(row[b, 4 + j]) >> 6) << 4))


@njit(inline="always", **EXACT)
def _sc_k16(row, b, code, g, half):
    """Signed scale of 16-value sub-block i = 2g + half of a q2_k (code 5; its min is
    row[b, i] >> 4), q3_k (6: low 4 bits from byte 96 + i%8, nibble i//8; high 2 from byte
    104 + i%4, pair i//4; minus 32) or q6_k block (int8 at 192 + i)."""
    # masks and shifts, not % and //, in every index helper: numba's Python-style % and // of
    # a loop variable cost enough to stop LLVM unrolling the sub-block loop, then vectorizing
    if code == 5:
        return np.int32(row[b, 2 * g + half] & 15)
    if code == 6:
        lo = (np.int32(row[b, 96 + 2 * (g & 3) + half]) >> (4 * (g >> 2))) & 15
        hi = (np.int32(row[b, 104 + 2 * (g & 1) + half]) >> (2 * (g >> 1))) & 3
        return (lo | (hi << 4)) - 32
    return np.int32(np.int8(row[b, 192 + 2 * g + half]))


@njit(inline="always", **EXACT)
def _u_32(row, b, qs, h, l, half):
    """Unsigned quant l + 16*half of a q4_0/q4_1/q5_0/q5_1 block: nibble ``half`` of byte
    qs + l, with bit l + 16*half of the high bits h (0 for the 4-bit formats) as bit 4."""
    return np.uint8(((row[b, qs + l] >> (4 * half)) & 15) | (((h >> (l + 16 * half)) & 1) << 4))


@njit(inline="always", **EXACT)
def _u_k16(row, b, code, g, l):
    """Unsigned quant l (0..31) of 32-value group g (0..7) of a q2_k (code 5), q3_k (6; minus 4
    is the value) or q6_k block (minus 32)."""
    if code == 9:   # low 4 bits: nibble s>>1 of ql[h*64 + (s&1)*32 + l], s = g&3, h = g>>2;
        s = g & 3   # high 2 bits: pair s of qh[h*32 + l]
        lo = (row[b, (g >> 2) * 64 + (s & 1) * 32 + l] >> (4 * (s >> 1))) & 15
        return np.uint8(lo | (((row[b, 128 + (g >> 2) * 32 + l] >> (2 * s)) & 3) << 4))
    # two bits: pair g&3 of byte (g>>2)*32 + l of qs (at 16 or 32); q3_k: bit 2 = bit g of hmask[l]
    q = (row[b, (16 if code == 5 else 32) + (g >> 2) * 32 + l] >> (2 * (g & 3))) & 3
    return np.uint8(q | (((row[b, l] >> g) & 1) << 2) if code == 6 else q)


@njit(inline="always", **EXACT)
def _u_k45(row, b, qh, j, l):
    """Quant l of 32-value sub-block j of a q4_k (qh < 0, qs at 16) or q5_k block (qs at 48)."""
    q = (row[b, (16 if qh < 0 else 48) + (j >> 1) * 32 + l] >> (4 * (j & 1))) & 15
    return np.uint8(q | (((row[b, qh + l] >> j) & 1) << 4) if qh >= 0 else q)


# ---- dequantization: the order of float ops is gguf-py's, so results match bit for bit -------

@njit(**EXACT)
def _dq_32(row, out, qs, qh, mn, off, q8):
    """q4_0, q4_1, q5_0, q5_1 (qh, mn < 0: absent), q8_0: d*(q - off), or d*q + m with a min."""
    for b in range(row.shape[0]):
        d = _f16(row, b, 0)
        m = _f16(row, b, mn) if mn >= 0 else np.float32(0.0)
        h = _u32(row, b, qh) if qh >= 0 else np.uint32(0)
        for j in range(32):
            if q8:
                q = np.int32(np.int8(row[b, qs + j]))
            else:
                q = np.int32(_u_32(row, b, qs, h, j % 16, j // 16))
            if mn >= 0:
                out[b * 32 + j] = d * np.float32(q) + m
            else:
                out[b * 32 + j] = d * np.float32(q - off)


@njit(**EXACT)
def _dq_k16(row, out, code):
    """q2_k, q3_k, q6_k: sixteen 16-value sub-blocks, (d*sc)*q; q2_k then minus dmin*m."""
    off = 0 if code == 5 else (4 if code == 6 else 32)
    for b in range(row.shape[0]):
        d = _f16(row, b, 80 if code == 5 else (108 if code == 6 else 208))
        dmin = _f16(row, b, 82)
        for i in range(16):
            dl = d * np.float32(_sc_k16(row, b, code, i // 2, i % 2))
            ml = dmin * np.float32(row[b, i] >> 4)
            for l in range(16):
                q = np.int32(_u_k16(row, b, code, i // 2, (i % 2) * 16 + l)) - off
                v = dl * np.float32(q)
                out[b * 256 + i * 16 + l] = v - ml if code == 5 else v


@njit(**EXACT)
def _dq_k45(row, out, qh):
    """q4_k (qh < 0), q5_k: eight 32-value sub-blocks, (d*sc)*q - dmin*m."""
    for b in range(row.shape[0]):
        d, dmin = _f16(row, b, 0), _f16(row, b, 2)
        for j in range(8):
            sc, mn = _scale_min_k(row, b, j)
            dl, ml = d * np.float32(sc), dmin * np.float32(mn)
            for l in range(32):
                out[b * 256 + j * 32 + l] = dl * np.float32(_u_k45(row, b, qh, j, l)) - ml


@njit(**EXACT)
def dequant_row(row, code, out):
    """out f32[NB*V] = the values of row u8[NB,S] in format ``code`` (bit-exact gguf-py)."""
    check_code(code, row.shape[1])
    if out.shape[0] != row.shape[0] * values_of(code):
        raise ValueError("dequant_row: out must hold NB*V values")
    if code == 10:
        dequant_fp8_row(row, out)
    elif code == 11:
        dequant_mxfp4_row(row, out)
    elif code <= 4:
        qs, qh, mn, off = ((2, -1, -1, 8), (4, -1, 2, 0), (6, 2, -1, 16), (8, 4, 2, 0),
                           (2, -1, -1, 0))[code]
        _dq_32(row, out, qs, qh, mn, off, code == 4)
    elif code == 7 or code == 8:
        _dq_k45(row, out, 16 if code == 8 else -1)
    else:
        _dq_k16(row, out, code)


# ---- row dots ----------------------------------------------------------------------------------
# Every value is (a*u - c) * x, u the unsigned quant, a = d*sc and c = a*offset + dmin*m fixed per
# sub-block, one accumulator per block: a sum(q*x) per sub-block would cost a horizontal
# reduction each. Numba runs no SLP vectorizer, and LLVM fully unrolls a constant loop over one
# sub-block (16 or 32 values) before its loop vectorizer runs, leaving scalar code. So each
# vectorized loop runs over the positions l of a whole block (or of four 32-value blocks) and
# its body names every sub-block: a loop over them is unrolled first only while its body is
# small (q3_k's was not: 10x slower). The per-value helpers are plain kernels, inlined by LLVM
# with the literal arguments (numba-level inlining of them compiled 2-4x slower).

@njit(**SERIAL)
def _coef_32(row, b, qh, mn, off):
    """(a, c, high bits) of a 32-value block: its values are a*u - c."""
    d = _f16(row, b, 0)
    c = d * np.float32(off) - (_f16(row, b, mn) if mn >= 0 else np.float32(0.0))
    return d, c, (_u32(row, b, qh) if qh >= 0 else np.uint32(0))


@njit(inline="always", **SERIAL)
def _pair_32(row, xv, b, l, qs, h, a, c):
    """Values l and l + 16 of block b times x."""
    u0, u1 = np.float32(_u_32(row, b, qs, h, l, 0)), np.float32(_u_32(row, b, qs, h, l, 1))
    return (a * u0 - c) * xv[b, l] + (a * u1 - c) * xv[b, 16 + l]


@njit(inline="always", **SERIAL)
def _dot_32(row, xv, qs, qh, mn, off):
    """q4_0, q4_1, q5_0, q5_1: four blocks per loop over the 16 byte positions (q8_0: _simd.py)."""
    nb = row.shape[0]
    acc = np.float32(0.0)
    for b in range(0, nb - 3, 4):
        a0, c0, h0 = _coef_32(row, b, qh, mn, off)
        a1, c1, h1 = _coef_32(row, b + 1, qh, mn, off)
        a2, c2, h2 = _coef_32(row, b + 2, qh, mn, off)
        a3, c3, h3 = _coef_32(row, b + 3, qh, mn, off)
        t = np.float32(0.0)
        for l in range(16):
            t += (_pair_32(row, xv, b, l, qs, h0, a0, c0)
                  + _pair_32(row, xv, b + 1, l, qs, h1, a1, c1)
                  + _pair_32(row, xv, b + 2, l, qs, h2, a2, c2)
                  + _pair_32(row, xv, b + 3, l, qs, h3, a3, c3))
        acc += t
    for b in range(nb - nb % 4, nb):
        a, c, h = _coef_32(row, b, qh, mn, off)
        for l in range(16):
            acc += _pair_32(row, xv, b, l, qs, h, a, c)
    return acc


@njit(**SERIAL)
def _v_k16(row, xv, b, code, g, half, l, d, dmin):
    """Value half*16 + l of group g of a q2_k/q3_k/q6_k block times x."""
    a = d * np.float32(_sc_k16(row, b, code, g, half))
    c = a * np.float32(0 if code == 5 else (4 if code == 6 else 32))
    if code == 5:
        c += dmin * np.float32(row[b, 2 * g + half] >> 4)
    u = np.float32(_u_k16(row, b, code, g, half * 16 + l))
    return (a * u - c) * xv[b, g * 32 + half * 16 + l]


@njit(inline="always", **SERIAL)
def _dot_k16(row, xv, code):
    """q2_k, q3_k, q6_k: per half of the 32-value groups, a loop over 16 positions x 8 groups."""
    acc = np.float32(0.0)
    for b in range(row.shape[0]):
        d = _f16(row, b, 80 if code == 5 else (108 if code == 6 else 208))
        m = _f16(row, b, 82) if code == 5 else np.float32(0.0)
        for h in range(2):
            t = np.float32(0.0)
            for l in range(16):
                t += (_v_k16(row, xv, b, code, 0, h, l, d, m)
                      + _v_k16(row, xv, b, code, 1, h, l, d, m)
                      + _v_k16(row, xv, b, code, 2, h, l, d, m)
                      + _v_k16(row, xv, b, code, 3, h, l, d, m)
                      + _v_k16(row, xv, b, code, 4, h, l, d, m)
                      + _v_k16(row, xv, b, code, 5, h, l, d, m)
                      + _v_k16(row, xv, b, code, 6, h, l, d, m)
                      + _v_k16(row, xv, b, code, 7, h, l, d, m))
            acc += t
    return acc


# one compiled kernel per format, its loops specialised by the literal arguments (and ten small
# functions compile faster than one with all ten inlined)

@njit(**SERIAL)
def _dot_q4_0(row, xv):
    return _dot_32(row, xv, 2, -1, -1, 8)


@njit(**SERIAL)
def _dot_q4_1(row, xv):
    return _dot_32(row, xv, 4, -1, 2, 0)


@njit(**SERIAL)
def _dot_q5_0(row, xv):
    return _dot_32(row, xv, 6, 2, -1, 16)


@njit(**SERIAL)
def _dot_q5_1(row, xv):
    return _dot_32(row, xv, 8, 4, 2, 0)


@njit(**SERIAL)
def _dot_q2_k(row, xv):
    return _dot_k16(row, xv, 5)


@njit(**SERIAL)
def _dot_q3_k(row, xv):
    return _dot_k16(row, xv, 6)


@njit(**SERIAL)
def _dot_q4_k(row, xv):
    return dot_q4_k(row, xv)            # explicit vectors (kernels/_simd.py)


@njit(**SERIAL)
def _dot_q5_k(row, xv):
    return dot_q5_k(row, xv)            # explicit vectors (kernels/_simd.py)


@njit(**SERIAL)
def _dot_q6_k(row, xv):
    return dot_q6_k(row, xv)            # explicit vectors (kernels/_simd.py)


@njit(inline="always", **SERIAL)
def _dot_xv(row, code, xv):
    """dot_row with x as xv f32[NB,V]: with a flat x[b*V + l], LLVM cannot prove the index
    non-negative (numba's integer products carry no no-overflow flag), keeps numba's
    negative-index wraparound in the loop and vectorizes with gathers."""
    if code == 10:
        return dot_fp8_row(row, xv)
    if code == 11:
        return dot_mxfp4_row(row, xv)
    if code == 0:
        return _dot_q4_0(row, xv)
    if code == 1:
        return _dot_q4_1(row, xv)
    if code == 2:
        return _dot_q5_0(row, xv)
    if code == 3:
        return _dot_q5_1(row, xv)
    if code == 4:
        return dot_q8_0(row, xv)        # explicit vectors (kernels/_simd.py): 2-3x _dot_q8_0
    if code == 5:
        return _dot_q2_k(row, xv)
    if code == 6:
        return _dot_q3_k(row, xv)
    if code == 7:
        return _dot_q4_k(row, xv)
    if code == 8:
        return _dot_q5_k(row, xv)
    return _dot_q6_k(row, xv)   # code 9; callers check_code first: a raise here, inlined into
    #                             dot_rows' prange body, would keep it from running in parallel


@njit(**SERIAL)
def dot_row(row, code, x):
    """sum(dequant(row) * x) for row u8[NB,S] in format ``code``, x f32[NB*V] (C-contiguous);
    fp32 accumulation, the blocks read in place."""
    check_code(code, row.shape[1])
    return _dot_xv(row, code, x.reshape(row.shape[0], values_of(code)))


@njit(**HOT)
def dot_rows(w, code, x, out):
    """out[r] = dot_row(w[r], code, x) for w u8[R,NB,S], x f32[NB*V], out f32[R]."""
    check_code(code, w.shape[2])
    xv = x.reshape(w.shape[1], values_of(code))
    for r in prange(w.shape[0]):
        out[r] = _dot_xv(w[r], code, xv)

