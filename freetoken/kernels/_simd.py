"""Row dots written as explicit LLVM vector code, for the block formats whose per-block structure
numba's auto-vectoriser leaves scalar (it runs no SLP pass, and LLVM unrolls a loop over one
block before the loop vectoriser sees it). The vectors are generic LLVM types (<32 x float>),
lowered by LLVM to whatever the host has: two AVX-512 registers, or four AVX2 ones.

Same spec and tolerance as the numba dots in qblocks.py: the blocks' values exactly, fp32 math in
another order (a block's scale applied once to its 32 products; the row's sum reassociated).

Each dot here is a plain function (the Python fallback, for uncompiled use) that numba
compiles through an overload: the vector IR in kernels/_simd_ir.py, registered by ``register``
when kernels/_numba.py loads numba.

Shapes: row u8[NB,S] (NB blocks of S bytes), xv f32[NB,V] (V values per block).
"""
import numpy as np

LANES = 32              # values per vector: one q8_0 block


def dot_q8_0(row, xv):
    """sum_b d_b * sum_l q[b,l] * xv[b,l] for a q8_0 row (d fp16 at byte 0, 32 int8 quants)."""
    d = np.ascontiguousarray(row[:, :2]).view(np.float16)[:, 0].astype(np.float32)
    q = np.ascontiguousarray(row[:, 2:34]).view(np.int8).astype(np.float32)
    return np.float32((d * (q * xv).sum(1, dtype=np.float32)).sum(dtype=np.float32))


def _f16(raw):
    return np.float32(np.frombuffer(raw.tobytes(), np.float16)[0])


def _scale_min_k4(sc):
    """The 8 (scale, min) 6-bit pairs packed in a q4_k block's 12 scale bytes."""
    sc = sc.astype(np.int32)
    scale = np.concatenate([sc[0:4] & 63, (sc[8:12] & 15) | ((sc[0:4] >> 6) << 4)])
    mins = np.concatenate([sc[4:8] & 63, (sc[8:12] >> 4) | ((sc[4:8] >> 6) << 4)])
    return scale.astype(np.float32), mins.astype(np.float32)


def _k45_row(row, xv, qh_at, qs_at):
    total = np.float32(0.0)
    for b in range(row.shape[0]):
        scale, mins = _scale_min_k4(row[b, 4:16])
        qs = row[b, qs_at:qs_at + 128].reshape(4, 32)
        q = np.stack([qs & 15, qs >> 4], 1).reshape(8, 32).astype(np.int32)
        if qh_at is not None:                              # bit j of each qh byte: sub-block j's 16
            q |= ((row[b, qh_at:qh_at + 32][None, :] >> np.arange(8)[:, None]) & 1).astype(np.int32) << 4
        a, c = _f16(row[b, 0:2]) * scale, _f16(row[b, 2:4]) * mins
        total += ((a[:, None] * q.astype(np.float32) - c[:, None]) * xv[b].reshape(8, 32)).sum(dtype=np.float32)
    return np.float32(total)


def dot_q4_k(row, xv):
    """sum over blocks b and sub-blocks j of (d*scale_j * q - dmin*min_j) . x for a q4_k row: d, dmin
    fp16 at bytes 0, 2; 6-bit scales and mins at 4; quants at 16, sub-blocks 2p and 2p + 1 in the
    low and high nibbles of bytes 16 + 32p .. + 31."""
    return _k45_row(row, xv, None, 16)


def dot_q5_k(row, xv):
    """dot_q4_k's sum for a q5_k row: quants at 48, and bit j of the 32 bytes at 16 as the fifth
    bit (16) of sub-block j's values."""
    return _k45_row(row, xv, 16, 48)


def dot_q6_k(row, xv):
    """sum over blocks of (d * scale_i * (q - 32)) . x for a q6_k row: low 4 bits at byte 0 (ql),
    high 2 at 128 (qh), 16 int8 scales at 192, d fp16 at 208, unpacked as gguf-py does."""
    total = np.float32(0.0)
    for b in range(row.shape[0]):
        ql, qh = row[b, :128].astype(np.int32), row[b, 128:192].astype(np.int32)
        q = np.empty(256, np.int32)
        for n in range(2):
            lo, hi, h = ql[64 * n:64 * n + 32], ql[64 * n + 32:64 * n + 64], qh[32 * n:32 * n + 32]
            q[128 * n:128 * n + 128] = np.concatenate([
                (lo & 15) | ((h & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4),
                (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4)])
        a = _f16(row[b, 208:210]) * row[b, 192:208].view(np.int8).astype(np.float32)
        total += (np.repeat(a, 16) * (q - 32).astype(np.float32) * xv[b]).sum(dtype=np.float32)
    return np.float32(total)


def register(numba):
    """Compile-time overloads of the dots above (kernels/_simd_ir.py; called once, when numba is
    loaded: importing that module registers them)."""
    import importlib
    importlib.import_module("freetoken.kernels._simd_ir")
