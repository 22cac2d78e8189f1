"""MXFP4 blocks (format ``mxfp4`` in kernels/qformats.py, GGML type 39, gpt-oss's expert weights):
the numba row kernels qblocks dispatches to. The spec is gguf-py's ``dequantize`` (qformats).

A block holds 32 values in 17 bytes: byte 0 an E8M0 exponent e, bytes 1-16 the 4-bit E2M1 codes,
value j < 16 in the low nibble of byte 1 + j and value j + 16 in its high nibble. A code's value
is KVALUES[code] (E2M1 doubled: integers) times 2**(e - 128), the "half" scale, which is exactly
E2M1 times 2**(e - 127). Every value is exact in fp32 (a small integer times a power of two), so
the dequantization is bit-exact whatever the order of operations; the dot accumulates in fp32.

Shape legend: NB blocks per row, 32 values each.
"""
import numpy as np

from freetoken.kernels._numba import SERIAL, from_bits, njit

BLOCK, BYTES = 32, 17
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
EXACT = dict(cache=True, nogil=True)


@njit(inline="always", **EXACT)
def half_scale(e):
    """2**(e - 128) as f32, from its bits (gguf-py's e8m0_to_fp32_half: subnormal for e < 2)."""
    e = np.uint32(e)
    if e < 2:
        return from_bits(np.uint32(0x00200000) << e)
    return from_bits((e - np.uint32(1)) << np.uint32(23))


@njit(inline="always", **EXACT)
def _code(row, b, j):
    """The 4-bit code of value j of block b."""
    return (row[b, 1 + (j & 15)] >> (4 * (j >> 4))) & 15


@njit(**EXACT)
def dequant_mxfp4_row(row, out):
    """out f32[NB*32] = the values of row u8[NB,17]."""
    kv = KVALUES
    for b in range(row.shape[0]):
        d = half_scale(row[b, 0])
        for j in range(BLOCK):
            out[b * BLOCK + j] = kv[_code(row, b, j)] * d


@njit(**SERIAL)
def dot_mxfp4_row(row, xv):
    """sum(dequant(row) * x), xv f32[NB,32]: each block's 32 products summed, then scaled once."""
    kv = KVALUES
    acc = np.float32(0.0)
    for b in range(row.shape[0]):
        t = np.float32(0.0)
        for j in range(16):
            q = row[b, 1 + j]
            t += kv[q & 15] * xv[b, j] + kv[q >> 4] * xv[b, 16 + j]
        acc += t * half_scale(row[b, 0])
    return acc
