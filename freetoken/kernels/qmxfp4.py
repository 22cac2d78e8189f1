"""MXFP4 blocks (format ``mxfp4`` in kernels/qformats.py, GGML type 39, gpt-oss's expert weights):
the numba row kernels qblocks dispatches to. The spec is gguf-py's ``dequantize`` (qformats).

A block holds 32 values in 17 bytes: byte 0 an E8M0 exponent e, bytes 1-16 the 4-bit E2M1 codes,
value j < 16 in the low nibble of byte 1 + j and value j + 16 in its high nibble. A code's value
is KVALUES[code] (E2M1 doubled: integers) times 2**(e - 128), the "half" scale, which is exactly
E2M1 times 2**(e - 127). Every value is exact in fp32 (a small integer times a power of two), so
the dequantization is bit-exact whatever the order of operations; the dot accumulates in fp32.

The hub's gpt-oss checkpoints store the same blocks another way (``_blocks`` u8[..., NB, 16] with
value 2i in the low nibble of byte i and 2i + 1 in its high one, the exponents apart in ``_scales``
u8[..., NB]): ``from_hub_blocks`` re-packs them into this format, exactly (the same codes, the same
exponent).

Shape legend: R rows, NB blocks per row, 32 values each.
"""
import numpy as np

from freetoken.kernels._numba import HOT, SERIAL, from_bits, njit, prange

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


def from_hub_blocks(blocks, scales, row_order=None, out=None):
    """u8[R, NB, 17] in this format from the hub's blocks u8[R, NB, 16] and exponents u8[R, NB]
    (module doc); row_order int[R]: row r of the result is stored row row_order[r]."""
    R, NB = scales.shape
    assert blocks.shape == (R, NB, 16), (blocks.shape, scales.shape)
    order = np.arange(R, dtype=np.int64) if row_order is None else np.asarray(row_order, np.int64)
    out = np.empty((R, NB, BYTES), np.uint8) if out is None else out
    _repack_rows(blocks, scales, order, out)
    return out


@njit(**HOT)
def _repack_rows(blocks, scales, order, out):
    """Value j (< 16) of a block: nibble j % 2 of stored byte j // 2; value j + 16: the same
    nibble of byte 8 + j // 2; they share byte 1 + j here, low and high."""
    for r in prange(out.shape[0]):
        src = order[r]
        for b in range(out.shape[1]):
            out[r, b, 0] = scales[src, b]
            for i in range(8):
                lo, hi = blocks[src, b, i], blocks[src, b, 8 + i]
                out[r, b, 1 + 2 * i] = (lo & 15) | ((hi & 15) << 4)
                out[r, b, 2 + 2 * i] = (lo >> 4) | (hi & 240)
