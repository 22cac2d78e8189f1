"""q4_0 rows interleaved 16 at a time, the kernels' side: the CPU layout of a q4_0 expert bank
(and of a model's q4_0 qkv and o_proj) made at load (kernels/qformats.py's LAYOUTS entry "q4_0x16"; its bytes: kernels/qlayout.py), so
that a decode GEMV's int8 dot gives 16 rows a step (kernels/_simd_interleave.py). Why: in the
file's layout each row's 32-value blocks end in a horizontal sum of the dot's lanes before the
block's scale applies, about half of a q4_0 row dot's time; with lane j of every vpdpbusd holding
row j, the lanes are the 16 rows' sums and no horizontal sum remains (bench/kernels/interleave.py;
bench/kernels/q4_0_repack_probe.c in C).

A bank u8[S, R, NB, 18] becomes u8[S, R/16, NB, 288] over the same bytes (``interleave``: in
place, so the bank's memory is not doubled). Only the cpu backend takes it, and only where the
int8 tile GEMM runs its prefill (VNNI; engine/build.interleaved_q4_0): every kernel that reads
the bank there reads this layout; GPU slots and the hybrid's CPU branch keep the file's. (The dot and
the tile GEMM's unpacking: _simd.idot_q4_0x16, _simd.unpack_q4_0x16.)

Shape legend: S experts, R rows, NB blocks per row, G = 16 rows per group.
"""
import numpy as np

from freetoken.kernels._numba import HOT, SERIAL, njit, prange
from freetoken.kernels._simd import unpack_q4_0x16
from freetoken.kernels.qformats import format_named, is_quantized, format_of
from freetoken.kernels.qlayout import BLOCK, ENTRY, G, QS_AT

CODE = format_named("q4_0x16").code       # the kernels' switch value
Q4_0 = format_named("q4_0").code


@njit(inline="always", **SERIAL)
def rows_per(code):
    """Rows per entry of format ``code``: G for the interleaved layout, else 1."""
    return G if code == CODE else 1


@njit(**SERIAL)
def _interleave_group(src, dst):
    """One group: src u8[G, NB, 18] (a copy) into dst u8[NB, 288]."""
    for b in range(src.shape[1]):
        for j in range(G):
            dst[b, 2 * j] = src[j, b, 0]
            dst[b, 2 * j + 1] = src[j, b, 1]
            for c in range(4):
                for i in range(4):
                    dst[b, QS_AT + 64 * c + 4 * j + i] = src[j, b, 2 + 4 * c + i]


@njit(**HOT)
def _interleave_all(flat, groups, nb):
    """flat u8[groups * G * NB * 18], in place, group by group (each in its own bytes)."""
    for g in prange(groups):
        span = flat[g * ENTRY * nb:(g + 1) * ENTRY * nb]
        _interleave_group(span.copy().reshape(G, nb, BLOCK), span.reshape(nb, ENTRY))


def can_interleave(w) -> bool:
    """Whether w is a C-contiguous, writable q4_0 weight u8[..., R, NB, 18] with R a multiple of G."""
    return (is_quantized(w) and format_of(w).code == Q4_0 and w.ndim >= 3 and w.shape[-3] % G == 0
            and w.flags.c_contiguous and w.flags.writeable)


def interleave(w):
    """The q4_0 weight w u8[..., R, NB, 18] as u8[..., R/G, NB, 288], rewritten in place (w's
    memory; w itself must not be read as q4_0 afterwards). ValueError unless can_interleave(w)."""
    if not can_interleave(w):
        raise ValueError(f"interleave takes C-contiguous q4_0 rows in groups of {G}; got "
                         f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    nb = w.shape[-2]
    groups = w.size // (ENTRY * nb)
    _interleave_all(w.reshape(-1), groups, nb)
    return w.reshape(*w.shape[:-3], w.shape[-3] // G, nb, ENTRY)


@njit(**SERIAL)
def dequant_groups(w, out):
    """out f32[R, NB*32] = the values of an interleaved weight's rows (w u8[R/16, NB, 288]),
    d * (u - 8) in fp32 as gguf-py's q4_0 (one rounding: u - 8 is exact), each row unpacked as the
    int8 tile GEMM unpacks it (_simd.unpack_q4_0x16)."""
    if out.shape[0] != w.shape[0] * G or out.shape[1] != w.shape[1] * 32:
        raise ValueError("dequant_groups: out must be f32[16 * groups, NB * 32]")
    u = np.empty(out.shape[1], np.uint8)
    a, c = np.empty(w.shape[1], np.float32), np.empty(w.shape[1], np.float32)
    for g in range(w.shape[0]):
        for j in range(G):
            unpack_q4_0x16(w[g], j, u, a, c)
            for v in range(out.shape[1]):
                out[G * g + j, v] = a[v // 32] * (np.float32(u[v]) - np.float32(8.0))


def row_range(w, m0, m1):
    """Rows m0 .. m1 of a weight w: w[m0:m1], or the groups holding them when w is interleaved
    (m0 and m1 then multiples of G, as its row count is; ValueError otherwise)."""
    if not is_quantized(w) or format_of(w).rows == 1:
        return w[m0:m1]
    if m0 % G or m1 % G:
        raise ValueError(f"rows {m0}..{m1} of an interleaved weight do not start and end on groups of {G}")
    return w[m0 // G:m1 // G]


def require_int8(w, int8) -> None:
    """ValueError when the interleaved weight w would be read without int8 dots (the fp32 row dots
    read the file's layout only)."""
    if not int8 and is_quantized(w) and format_of(w).rows > 1:
        raise ValueError(f"{format_of(w).name} weights (rows interleaved at load) are read with int8 "
                         "dots only (--cpu-dots int8)")
