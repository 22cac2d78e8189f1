"""Row dots written as explicit LLVM vector code, for the block formats whose per-block structure
numba's auto-vectoriser leaves scalar (it runs no SLP pass, and LLVM unrolls a loop over one
block before the loop vectoriser sees it). The vectors are generic LLVM types (<32 x float>),
lowered by LLVM to whatever the host has: two AVX-512 registers, or four AVX2 ones.

Same spec and tolerance as the numba dots in qblocks.py: the blocks' values exactly, fp32 math in
another order (a block's scale applied once to its 32 products; the row's sum reassociated).

Each dot here is a plain function whose Python body is the spec (gguf-py's dequantize, then a
dot); numba compiles it through an overload instead: the vector IR in kernels/_simd_ir.py,
registered by ``register`` when kernels/_numba.py loads numba.

Shapes: row u8[NB,S] (NB blocks of S bytes), xv f32[NB,V] (V values per block).
"""
import numpy as np

LANES = 32              # values per vector: one q8_0 block


def _spec_dot(row, xv, ggml_type):
    """The Python fallback of every dot here: the spec itself, the row dequantized by gguf-py
    (as qformats.dequantize_ref does; that module is not imported here: it imports _numba)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    values = dequantize(np.ascontiguousarray(row).reshape(-1), GGMLQuantizationType[ggml_type])
    return np.float32(np.asarray(values, np.float32) @ np.ascontiguousarray(xv, np.float32).reshape(-1))


def dot_q8_0(row, xv):
    """d * (q . x) summed over a q8_0 row's blocks (d fp16 at byte 0, 32 int8 quants at 2)."""
    return _spec_dot(row, xv, "Q8_0")


def dot_q4_k(row, xv):
    """(d*scale_j * q - dmin*min_j) . x summed over a q4_k row's blocks and sub-blocks j: d, dmin
    fp16 at bytes 0, 2; 6-bit scales and mins at 4; quants at 16, sub-blocks 2p and 2p + 1 in the
    low and high nibbles of bytes 16 + 32p .. + 31."""
    return _spec_dot(row, xv, "Q4_K")


def dot_q5_k(row, xv):
    """dot_q4_k's sum for a q5_k row: quants at 48, and bit j of the 32 bytes at 16 as the fifth
    bit (16) of sub-block j's values."""
    return _spec_dot(row, xv, "Q5_K")


def dot_q6_k(row, xv):
    """(d * scale_i * (q - 32)) . x summed over a q6_k row's blocks: low 4 bits at byte 0 (ql),
    high 2 at 128 (qh), 16 int8 scales at 192, d fp16 at 208, unpacked as gguf-py does."""
    return _spec_dot(row, xv, "Q6_K")


def register(numba):
    """Compile-time overloads of the dots above (kernels/_simd_ir.py; called once, when numba is
    loaded: importing that module registers them)."""
    import importlib
    importlib.import_module("freetoken.kernels._simd_ir")
