"""Qwen's block FP8 as row blocks (format ``fp8_b128`` in kernels/qformats.py): the spec and the
numba row kernels qblocks dispatches to.

A checkpoint stores W [M, K] as float8_e4m3fn codes q plus ``weight_scale_inv`` s of shape
[ceil(M/128), ceil(K/128)], W[m, k] = e4m3(q[m, k]) * s[m // 128, k // 128] in fp32 (what
transformers' finegrained-FP8 dequantization computes on a CPU: the code widened, times the scale
widened, one rounding). FreeToken keeps each row's blocks of 128 values as [f32 scale, 128 codes]
(132 bytes): the scale is repeated for the 128 rows that share it (3% more bytes), and in return
every row-wise kernel and the slot pool take FP8 like the GGUF formats. K must be a multiple of 128
(every Qwen FP8 release's is); the loader widens a tensor whose K is not.

e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2**-9);
0x7F and 0xFF are NaN; there is no infinity.

Shape legend: M rows, K values per row, NB = K/128 blocks per row.
"""
import numpy as np

from freetoken.kernels._numba import SERIAL, from_bits, njit

BLOCK = 128
EXACT = dict(cache=True, nogil=True)   # dequantization must not contract or reassociate


def e4m3_table() -> np.ndarray:
    """f32[256]: every e4m3fn code's value (the spec of one code)."""
    code = np.arange(256)
    exp, man = (code >> 3) & 15, code & 7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7.0))
    val = np.where(code & 0x80, -mag, mag)
    return np.where((code & 0x7F) == 0x7F, np.nan, val).astype(np.float32)


def dequantize_fp8(w: np.ndarray) -> np.ndarray:
    """u8[..., NB, 132] -> f32[..., NB*128]: each code's value times its block's f32 scale."""
    w = np.ascontiguousarray(w)
    scale = w[..., :4].copy().view(np.float32)                         # [..., NB, 1]
    return (e4m3_table()[w[..., 4:]] * scale).reshape(*w.shape[:-2], w.shape[-2] * BLOCK)


def to_row_blocks(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's fp8 codes u8[..., M, K] and scales [..., ceil(M/128), K/128] (any float
    dtype: widened exactly) -> u8[..., M, K/128, 132]."""
    *lead, M, K = codes.shape
    out = np.empty((*lead, M, K // BLOCK, 4 + BLOCK), np.uint8)
    per_row = np.repeat(np.asarray(scales, np.float32), BLOCK, axis=-2)[..., :M, :]   # [..., M, NB]
    out[..., :4] = np.ascontiguousarray(per_row)[..., None].view(np.uint8)
    out[..., 4:] = codes.reshape(*lead, M, K // BLOCK, BLOCK)
    return out


def quantize_fp8_rows(w: np.ndarray) -> np.ndarray:
    """f32[..., K] (K a multiple of 128) -> u8[..., K/128, 132]: per block of 128 values of a row,
    scale = amax / 448 (e4m3's largest) and each value's nearest code (--quantize-experts fp8)."""
    blocks = np.asarray(w, np.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    scale = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(448.0), np.float32(1e-30))
    mags = e4m3_table()[:0x7F]                                       # codes 0..126, ascending
    v = np.abs(blocks / scale)
    hi = np.clip(np.searchsorted(mags, v), 1, len(mags) - 1)
    code = np.where(v - mags[hi - 1] <= mags[hi] - v, hi - 1, hi).astype(np.uint8)
    out = np.empty(blocks.shape[:-1] + (4 + BLOCK,), np.uint8)
    out[..., :4] = scale.astype(np.float32).view(np.uint8)
    out[..., 4:] = np.where(blocks < 0, code | np.uint8(0x80), code)
    return out


@njit(inline="always", **EXACT)
def _scale(row, b):
    return from_bits(np.uint32(row[b, 0]) | (np.uint32(row[b, 1]) << np.uint32(8))
                     | (np.uint32(row[b, 2]) << np.uint32(16)) | (np.uint32(row[b, 3]) << np.uint32(24)))


@njit(inline="always", **EXACT)
def _value(q):
    """e4m3fn code -> f32, exactly (a normal one as fp32 bits, a subnormal by arithmetic)."""
    q = np.uint32(q)
    e, m = (q >> np.uint32(3)) & np.uint32(15), q & np.uint32(7)
    if (q & np.uint32(0x7F)) == np.uint32(0x7F):
        return np.float32(np.nan)
    if e == 0:
        v = np.float32(m) * np.float32(2.0 ** -9)
        return -v if q & np.uint32(0x80) else v
    return from_bits(((q & np.uint32(0x80)) << np.uint32(24)) | ((e + np.uint32(120)) << np.uint32(23))
                     | (m << np.uint32(20)))


@njit(**EXACT)
def dequant_fp8_row(row, out):
    """out f32[NB*128] = row u8[NB,132]'s values (bit-exact dequantize_fp8)."""
    for b in range(row.shape[0]):
        s = _scale(row, b)
        for i in range(BLOCK):
            out[b * BLOCK + i] = _value(row[b, 4 + i]) * s


@njit(inline="always", **SERIAL)
def _value_fast(q):
    """_value without branches, for the dots: the code's 7 low bits placed at fp32's exponent and
    mantissa (e4m3's exponent 0 lands on fp32's subnormals, e > 0 on normals) times 2^120, which
    re-biases both exactly (m * 2^-9 and (1 + m/8) * 2^(e-7)); the sign bit moved to bit 31; NaN
    codes selected apart."""
    q = np.uint32(q)
    v = from_bits((q & np.uint32(0x80)) << np.uint32(24) | (q & np.uint32(0x7F)) << np.uint32(20))
    return np.float32(np.nan) if (q & np.uint32(0x7F)) == np.uint32(0x7F) else v * np.float32(2.0 ** 120)


@njit(**SERIAL)
def dot_fp8_row(row, xv):
    """sum(dequant(row) * x), xv f32[NB,128]; the scale applied once per block."""
    acc = np.float32(0.0)
    for b in range(row.shape[0]):
        t = np.float32(0.0)
        for i in range(BLOCK):
            t += _value_fast(row[b, 4 + i]) * xv[b, i]
        acc += t * _scale(row, b)
    return acc
