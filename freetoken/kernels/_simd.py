"""Row dots written as explicit LLVM vector code, for the block formats whose per-block structure
numba's auto-vectoriser leaves scalar (it runs no SLP pass, and LLVM unrolls a loop over one
block before the loop vectoriser sees it). The vectors are generic LLVM types (<32 x float>),
lowered by LLVM to whatever the host has: two AVX-512 registers, or four AVX2 ones.

Same spec and tolerance as the numba dots in qblocks.py: the blocks' values exactly, fp32 math in
another order (a block's scale applied once to its 32 products; the row's sum reassociated).

Each dot here is a plain function whose Python body is the spec (gguf-py's dequantize, then a
dot); numba compiles it through an overload instead: the vector IR in kernels/_simd_ir.py,
registered by ``register`` when kernels/_numba.py loads numba.

The ``idot_*`` dots read x rounded to 8 bits per 32 values (kernels/qact.py) and compute each
32 values' sum as an exact integer (VNNI, or AVX2's pairwise multiply-adds: kernels/_simd_int8.py;
the low-bit and legacy formats' blocks in kernels/_simd_int8_low.py),
scaled once; their spec: the dot of the dequantized row with the rounded x (q * d).

Shapes: row u8[NB,S] (NB blocks of S bytes), xv f32[NB,V] (V values per block); rounded x: xq
i8[NB,V], xd and xs f32[NB,V/32] (the scale, and scale * sum of q, of each 32 values; the xs of
q2_k, q3_k and q6_k, whose scales are per 16 values: f32[NB,V/16], qact.sums16).
"""
import numpy as np

LANES = 32              # values per vector: one q8_0 block
PREFETCH_BYTES = 4096   # how far ahead of the row being read prefetch_ahead asks for rows
KV_AHEAD = 8            # decode attention: KV records asked for this many slots ahead of the one read
V_BLOCK = 64            # values of D in one weighted_v_rows block


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


def _spec_idot(row, xq, xd, ggml_type):
    """The spec of the int8 dots: the rounded x as the values it stands for, then _spec_dot."""
    x = np.asarray(xq, np.float32).reshape(-1, 32) * np.asarray(xd, np.float32).reshape(-1, 1)
    return _spec_dot(row, x, ggml_type)


def idot_q8_0(row, xq, xd, xs):
    """dot_q8_0 of the rounded x: per block, d * xd * (the exact integer sum of q * xq)."""
    return _spec_idot(row, xq, xd, "Q8_0")


def idot_q4_k(row, xq, xd, xs):
    """dot_q4_k of the rounded x: per sub-block j, d*scale_j * xd_j * sum(q * xq) - dmin*min_j * xs_j."""
    return _spec_idot(row, xq, xd, "Q4_K")


def idot_q5_k(row, xq, xd, xs):
    """dot_q5_k of the rounded x, as idot_q4_k."""
    return _spec_idot(row, xq, xd, "Q5_K")


def idot_q6_k(row, xq, xd, xs):
    """dot_q6_k of the rounded x: per 16 values, d*scale_i * xd * sum((q - 32) * xq). (xs,
    xd times each 16 values' sum of xq (qact.sums16), is how the compiled dot takes off the 32.)"""
    return _spec_idot(row, xq, xd, "Q6_K")


def idot_q4_0(row, xq, xd, xs):
    """dot of a q4_0 row with the rounded x: per block, d * (xd * sum(u * xq) - 8 * xs), u the
    unsigned nibbles (the value is u - 8; xs = xd * sum(xq), qact's s, takes the 8 off once)."""
    return _spec_idot(row, xq, xd, "Q4_0")


def idot_q4_1(row, xq, xd, xs):
    """dot of a q4_1 row with the rounded x: per block, d * xd * sum(u * xq) + m * xs."""
    return _spec_idot(row, xq, xd, "Q4_1")


def idot_q5_0(row, xq, xd, xs):
    """idot_q4_0 for q5_0: u has the fifth bit (16) from the block's 32 high bits; the value is u - 16."""
    return _spec_idot(row, xq, xd, "Q5_0")


def idot_q5_1(row, xq, xd, xs):
    """idot_q4_1 for q5_1 (u with its fifth bit, as q5_0's)."""
    return _spec_idot(row, xq, xd, "Q5_1")


def idot_q2_k(row, xq, xd, xs):
    """dot of a q2_k row with the rounded x: per 16 values, d*scale_i * xd * sum(u * xq) -
    dmin*min_i * xs_i (xs per 16 values, qact.sums16), u the 2-bit quants."""
    return _spec_idot(row, xq, xd, "Q2_K")


def idot_q3_k(row, xq, xd, xs):
    """dot of a q3_k row with the rounded x: per 16 values, d*scale_i * (xd * sum(u * xq) - 4 *
    xs_i) (xs per 16 values, qact.sums16), u the 3-bit quants (the value is u - 4)."""
    return _spec_idot(row, xq, xd, "Q3_K")


def idot_mxfp4(row, xq, xd, xs):
    """dot of an mxfp4 row (kernels/qmxfp4.py) with the rounded x: per block, 2**(e - 128) * xd *
    (the exact integer sum of the doubled e2m1 values times xq)."""
    return _spec_idot(row, xq, xd, "MXFP4")


def idot_q4_0x16(entries, xq, xd, xs, out):
    """out f32[16] (any stride) = idot_q4_0 of each of the 16 q4_0 rows of one interleaved group
    (kernels/qinterleave.py; entries u8[NB,288]) with the rounded x. Compiled by
    kernels/_simd_interleave.py: lane j of each vpdpbusd is row j, no per-block horizontal sums."""
    from freetoken.kernels.qlayout import deinterleave
    rows = deinterleave(np.asarray(entries)[None])
    for j in range(rows.shape[0]):
        out[j] = idot_q4_0(rows[j], xq, xd, xs)


def prefetch_ahead(w, r):
    """A hint, no result: ask the cache for the row about PREFETCH_BYTES past row r of w (an
    array of rows w[i], each contiguous; nothing past its end). Compiled (kernels/_simd_ir.py) to one
    llvm.prefetch per 64 bytes of that row; in Python, nothing. Why: a decode GEMV reads every
    weight row once from memory, and the hardware prefetchers alone left the int8 dots waiting
    on it (a q4_k GEMV over 8 cold 1024 x 1024 matrices, 2 threads, Xeon EMR VM: 9.4-9.5 GB/s
    without, 14-15 with rows 2.3-9 KB ahead)."""


def prefetch_row(w, r):
    """A hint, no result: ask the cache for row r of w itself (as prefetch_ahead; nothing when
    r is outside w). Why: decode attention reads its KV records in the slot table's order,
    which no hardware prefetcher follows."""


def weighted_v_rows(p, v, slots, j0, j1, g, r0, d0, out):
    """out[g, r, d0:d0+V_BLOCK] += the sum over j0 <= j < j1 of p[g, r, j] * v[slots[j], g,
    d0:d0+V_BLOCK] (bf16 bits or f32), for the heads r0 .. r0+3 that exist: decode attention's
    weighted V rows (kernels/attention_decode.py), fp32 multiply-adds in slot order. Compiled by
    kernels/_simd_attn.py with the block's sums in registers; a block at r0 = 0 also asks for its
    piece of the records KV_AHEAD slots on (the slot table's order is no stream a prefetcher
    follows)."""
    heads = slice(r0, min(r0 + 4, out.shape[1]))
    rows = v[slots[j0:j1], g, d0:d0 + V_BLOCK]
    rows = (rows.astype(np.uint32) << 16).view(np.float32) if rows.dtype == np.uint16 else rows
    for j in range(j0, j1):
        out[g, heads, d0:d0 + V_BLOCK] += p[g, heads, j, None] * rows[j - j0]


def head_scores(q, k, slots, j0, g, r0, scale, s):
    """s[g, r, j] = scale * (q[g, r] . k[slots[j], g]) (bf16 bits or f32) for the heads r0 .. r0+3
    and the slots j0 .. j0+3: decode attention's scores (kernels/attention_decode.py), D a
    multiple of 16, fp32 sums in any order. Compiled by kernels/_simd_attn.py: 16 partial vectors
    and one shuffle tree, where a dot at a time ends each in a horizontal sum; the block at r0 = 0
    also asks for group g's keys of the 4 slots KV_AHEAD on."""
    keys = k[slots[j0:j0 + 4], g]
    keys = (keys.astype(np.uint32) << 16).view(np.float32) if keys.dtype == np.uint16 else keys
    s[g, r0:r0 + 4, j0:j0 + 4] = scale * (q[g, r0:r0 + 4] @ keys.T)


def _unpack_stub(name):
    """unpack_<name>(row, u, a, c): a quantized row's values as u u8[K] (a byte a value) and each
    group's a and c f32[K/G], the values being a*(u - off) - c (kernels/_simd_itile.py's groups,
    off from qgemm.GROUPS; c = 0 where the format has no mins). Compiled only (kernels/_simd_igemm.py): the (u, a, c) are the
    format's own fields, and what the spec fixes is igemm's result against the dequantized row
    (tests/kernels/test_qgemm.py)."""
    def unpack(row, u, a, c):
        raise NotImplementedError(f"unpack_{name} is compiled only (kernels/_simd_igemm.py)")
    unpack.__name__ = unpack.__qualname__ = f"unpack_{name}"
    unpack.__doc__ = _unpack_stub.__doc__.replace("<name>", name)
    return unpack


unpack_q8_0, unpack_q4_k, unpack_q5_k, unpack_q6_k, unpack_mxfp4 = map(_unpack_stub, ("q8_0", "q4_k", "q5_k", "q6_k",
                                                                                     "mxfp4"))
unpack_q4_0, unpack_q4_1, unpack_q5_0, unpack_q5_1, unpack_q2_k, unpack_q3_k = map(
    _unpack_stub, ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k"))


def unpack_q4_0x16(entries, j, u, a, c):
    """unpack_q4_0 of row j of an interleaved q4_0 group (entries u8[NB,288], kernels/qlayout.py).
    Compiled only (kernels/_simd_interleave.py)."""
    raise NotImplementedError("unpack_q4_0x16 is compiled only (kernels/_simd_interleave.py)")


def _spec_igemm(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out, G):
    """The spec of the products: out[j*TT + t] = unpacked row r0 + j against tile t0 + t, per group
    a * xd * (sum(u * xq) + xb) - c * xs (with has_min), in float64."""
    tiles, K = out.shape[0] // 4, u.shape[1]
    q = np.asarray(xt[t0:t0 + tiles], np.int64).reshape(tiles, K // 4, 16, 4).transpose(0, 2, 1, 3).reshape(tiles, 16, K)
    for j in range(4):
        rows = np.asarray(u[r0 + j], np.int64).reshape(-1, G)
        for t in range(tiles):
            sums = (q[t].reshape(16, -1, G) * rows[None]).sum(axis=2) + xb[t0 + t].T          # [16, K/G]
            scale = np.repeat(np.asarray(xd[t0 + t], np.float64).T, 32 // G, axis=1) * a[r0 + j]
            low = (c[r0 + j] * np.asarray(xs[t0 + t], np.float64).T).sum(axis=1) if has_min else 0.0
            out[j * tiles + t] = (sums * scale).sum(axis=1) - low


def igemm_g32(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out):
    """out f32[4*TT,16]: unpacked rows r0 .. r0+3 (u, a, c from unpack_*, groups of 32) against
    tiles t0 .. t0+TT-1 (TT = 2 where out has 8 rows, else 1); kernels/_simd_igemm.py."""
    _spec_igemm(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out, 32)


def igemm_g16(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out):
    """igemm_g32 for groups of 16 values (q2_k, q3_k, q6_k)."""
    _spec_igemm(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out, 16)


def btile_bf16(w, xt, r0, t0, out):
    """out[r0:r0+4, t0:t0+2] (f32[R,NT,16]) = bf16 rows r0 .. r0+3 of w (u32[R,K/2], pairs) against
    tiles t0, t0+1 of xt (u32[NT,K/2,16]: 16 tokens' bf16 values, two a word): fp32 sums of the
    exact bf16 products (kernels/_simd_bf16.py: AVX512-BF16's vdpbf16ps, denormals flushed)."""
    from freetoken.kernels._bf16 import to_f32
    rows = to_f32(np.ascontiguousarray(w[r0:r0 + 4]).view(np.uint16))                 # [4,K]
    tiles = np.ascontiguousarray(xt[t0:t0 + 2].transpose(0, 2, 1)).view(np.uint16)     # [2,16,K]
    out[r0:r0 + 4, t0:t0 + 2] = np.einsum("rk,tlk->rtl", rows, to_f32(tiles))


def bdot_rows2(w, xw, r0, r1):
    """(w[r0] . x, w[r1] . x) for bf16-pair rows w u32[M,K/2] and one token's bf16 values two a word,
    xw u32[K/2]: fp32 sums of the exact bf16 products (kernels/_simd_bf16.py: vdpbf16ps where the
    target has AVX512-BF16, denormals flushed; fp32 FMAs elsewhere)."""
    return tuple(_bf16_dot(w[r], xw) for r in (r0, r1))


def bdot_rows4(w, xw, r0, r1, r2, r3):
    """bdot_rows2 for four rows."""
    return tuple(_bf16_dot(w[r], xw) for r in (r0, r1, r2, r3))


def bf16_dots_here():
    """Whether bdot_rows2/4 run on vdpbf16ps here, so a kernel keeps its fp32 path on a CPU without
    it (kernels/experts_pairs.py). Compiled: a constant of numba's target (_isa.bf16_dots); in
    Python, False (both paths compute the same spec)."""
    return False


def _bf16_dot(row, xw):
    from freetoken.kernels._bf16 import to_f32
    return np.float32(to_f32(row.view(np.uint16)).astype(np.float64) @ to_f32(xw.view(np.uint16)))


def register(numba):
    """Compile-time overloads of the dots above (kernels/_simd_ir.py, _simd_int8.py; called once,
    when numba is loaded: importing those modules registers them)."""
    import importlib
    importlib.import_module("freetoken.kernels._simd_ir")
    importlib.import_module("freetoken.kernels._simd_int8")
    importlib.import_module("freetoken.kernels._simd_int8_low")
    importlib.import_module("freetoken.kernels._simd_interleave")
    importlib.import_module("freetoken.kernels._simd_igemm")
    importlib.import_module("freetoken.kernels._simd_attn")
    importlib.import_module("freetoken.kernels._simd_bf16").enable_inline_asm()
