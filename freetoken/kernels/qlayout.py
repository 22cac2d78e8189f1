"""The byte layout of q4_0 rows interleaved 16 at a time (kernels/qformats.py's LAYOUTS entry
"q4_0x16"; its kernels: kernels/qinterleave.py, kernels/_simd_interleave.py), in numpy only,
so that qformats (the spec, dequantize_ref) and _simd (the Python form of the dots) read it
without importing the kernels.

Per group of 16 rows and per block column b, one entry of 288 bytes (16 blocks of 18):
    bytes 0 .. 31     the 16 rows' fp16 scales d, row j at 2j
    bytes 32 + 64c .. the 4 bytes 4c .. 4c+3 of each row's 16 quant bytes (c = 0 .. 3), row j
                      at 32 + 64c + 4j: its low nibbles are values 4c .. 4c+3, its high ones
                      16 + 4c .. 16 + 4c + 3
A weight u8[..., R, NB, 18] is u8[..., R/16, NB, 288] over the same bytes.
"""
import numpy as np

G = 16                     # rows per group
BLOCK = 18                 # a q4_0 block: fp16 d, 16 bytes of nibbles
ENTRY = G * BLOCK          # a group's bytes per block column
QS_AT = 2 * G              # where the quants start in an entry


def interleave_ref(w):
    """u8[..., R, NB, 18] -> a new u8[..., R/16, NB, 288] (kernels/qinterleave.interleave makes
    the same bytes in place)."""
    w = np.asarray(w, np.uint8)
    lead, R, nb = w.shape[:-3], w.shape[-3], w.shape[-2]
    rows = w.reshape(-1, R // G, G, nb, BLOCK).transpose(0, 1, 3, 2, 4)            # [., groups, NB, G, 18]
    qs = rows[..., 2:].reshape(*rows.shape[:-2], G, 4, 4).transpose(0, 1, 2, 4, 3, 5)
    entry = np.concatenate([rows[..., :2].reshape(*rows.shape[:-2], QS_AT), qs.reshape(*rows.shape[:-2], 4 * G * 4)], -1)
    return np.ascontiguousarray(entry).reshape(*lead, R // G, nb, ENTRY)


def deinterleave(w):
    """The q4_0 rows u8[..., R, NB, 18] of an interleaved weight u8[..., R/16, NB, 288] (new)."""
    w = np.asarray(w)
    lead, groups, nb = w.shape[:-3], w.shape[-3], w.shape[-2]
    e = w.reshape(-1, groups, nb, ENTRY)
    d = e[..., :QS_AT].reshape(-1, groups, nb, G, 2)
    qs = e[..., QS_AT:].reshape(-1, groups, nb, 4, G, 4).transpose(0, 1, 2, 4, 3, 5).reshape(-1, groups, nb, G, 16)
    blocks = np.concatenate([d, qs], axis=-1)                      # [., groups, NB, G, 18]
    return np.ascontiguousarray(blocks.transpose(0, 1, 3, 2, 4)).reshape(*lead, groups * G, nb, BLOCK)
