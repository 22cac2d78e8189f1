"""What the int8 tile GEMM (kernels/_simd_igemm.py) reads of each GGUF block format: a block's
groups of G values as (u, a, c) LLVM values, the values being a*(u - off) - c with u the unsigned
quants (bytes) and a, c fp32 (kernels/qgemm.py's GROUPS: G and the offset the tiles take off u; the AMX
tiles, kernels/_amx.py, read the same groups), and vpdpbusd at each width this CPU compiles.
Imported only by _simd.register, once numba is loaded."""
from llvmlite import ir

from freetoken.kernels._isa import int8_tile_path
from freetoken.kernels._simd_int8 import _kvalues, _q6_k_slices, idot, mxfp4_codes, mxfp4_half_scale
from freetoken.kernels._simd_int8_low import legacy_quants, q2_k_coefficients, q3_k_quants, q3_k_scales, two_bits
from freetoken.kernels._simd_ir import (F32, I8, I32, _bytes, _fp16, _function, _k4_coefficients, _lanes, _same,
                                        _splat)

LANES = 16
I8x64, I32x16, F32x16 = ir.VectorType(I8, 64), ir.VectorType(I32, LANES), ir.VectorType(F32, LANES)


def tile_path(features: str) -> str:
    """_isa.int8_tile_path of an LLVM feature string (numba's target machine's)."""
    return int8_tile_path({f[1:] for f in features.split(",") if f.startswith("+")})


def _vnni16(builder, acc, u4, x, path):
    """acc <16 x i32> + per lane the sum of 4 products of u4 <64 x i8> (unsigned) and x (signed)."""
    if path == "vnni512":
        step = _function(builder, "llvm.x86.avx512.vpdpbusd.512", I32x16, [I32x16, I8x64, I8x64])
        return builder.call(step, [acc, u4, x])
    halves = [idot(builder, _lanes(builder, u4, range(32 * h, 32 * h + 32)), _lanes(builder, x, range(32 * h, 32 * h + 32)),
                   _lanes(builder, acc, range(8 * h, 8 * h + 8)), "vnni" if path == "vnni" else "generic")
              for h in range(2)]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(I32x16, list(range(16))))


# ---- one block's groups: (u <G x i8>, a, c or None), in value order ---------------------------

def _groups_q8_0(builder, block):
    u = builder.xor(_bytes(builder, block, 2), _same(8, 32, 128))
    return [(u, _fp16(builder, block, 0), None)]


def _groups_k45(builder, block, qh_at, qs_at):
    a8, c8 = _k4_coefficients(builder, block)
    high_bits = _bytes(builder, block, qh_at) if qh_at is not None else None
    out = []
    for p in range(4):
        quants = _bytes(builder, block, qs_at + 32 * p)
        for half, u in enumerate((builder.and_(quants, _same(8, 32, 15)), builder.lshr(quants, _same(8, 32, 4)))):
            j = 2 * p + half
            if high_bits is not None:
                bit = builder.and_(builder.lshr(high_bits, _same(8, 32, j)), _same(8, 32, 1))
                u = builder.or_(u, builder.shl(bit, _same(8, 32, 4)))
            out.append((u, builder.extract_element(a8, ir.Constant(I32, j)), builder.extract_element(c8, ir.Constant(I32, j))))
    return out


def _groups_q6_k(builder, block):
    scales = builder.sitofp(_bytes(builder, block, 192, 16), F32x16)
    a16 = builder.fmul(scales, _splat(builder, _fp16(builder, block, 208), 16))
    out = []
    for n in range(2):
        for k, u in enumerate(_q6_k_slices(builder, block, n)):
            for h in range(2):
                out.append((_lanes(builder, u, range(16 * h, 16 * h + 16)),
                            builder.extract_element(a16, ir.Constant(I32, 8 * n + 2 * k + h)), None))
    return out


def _groups_mxfp4(builder, block, path):
    """u = the doubled e2m1 value + 12 (0..24; the tile's xb takes 12 * sum(xq) off), a the half
    scale 2**(e - 128)."""
    k = _kvalues(builder, mxfp4_codes(builder, block), "vnni" if path != "generic" else "generic")
    return [(builder.add(k, _same(8, 32, MXFP4_OFFSET)), mxfp4_half_scale(builder, block), None)]


def _groups_legacy(builder, block, qs_at, qh_at, min_at):
    """q4_0 / q5_0 (min_at None: the tile's xb takes the 8 or 16 off) and q4_1 / q5_1 (c = -min)."""
    u, d = legacy_quants(builder, block, qs_at, qh_at), _fp16(builder, block, 0)
    return [(u, d, None if min_at is None else builder.fsub(ir.Constant(F32, 0.0), _fp16(builder, block, min_at)))]


def _groups_k16(builder, slices, a16, c16):
    """The 16 groups of 16 values of a q2_k / q3_k block: halves of its 8 slices of 32."""
    pick = lambda v, i: builder.extract_element(v, ir.Constant(I32, i))                # noqa: E731
    return [(_lanes(builder, u, range(16 * h, 16 * h + 16)), pick(a16, 2 * g + h), None if c16 is None else pick(c16, 2 * g + h))
            for g, u in enumerate(slices) for h in range(2)]


MXFP4_OFFSET = 12
# format: (block bytes, values per block, group G, offset, groups of a block (builder, block, path))
FORMATS = {"q8_0": (34, 32, 32, 128, lambda b, blk, path: _groups_q8_0(b, blk)),
           "q4_k": (144, 256, 32, 0, lambda b, blk, path: _groups_k45(b, blk, None, 16)),
           "q5_k": (176, 256, 32, 0, lambda b, blk, path: _groups_k45(b, blk, 16, 48)),
           "q6_k": (210, 256, 16, 32, lambda b, blk, path: _groups_q6_k(b, blk)),
           "mxfp4": (17, 32, 32, MXFP4_OFFSET, _groups_mxfp4),
           "q4_0": (18, 32, 32, 8, lambda b, blk, path: _groups_legacy(b, blk, 2, None, None)),
           "q4_1": (20, 32, 32, 0, lambda b, blk, path: _groups_legacy(b, blk, 4, None, 2)),
           "q5_0": (22, 32, 32, 16, lambda b, blk, path: _groups_legacy(b, blk, 6, 2, None)),
           "q5_1": (24, 32, 32, 0, lambda b, blk, path: _groups_legacy(b, blk, 8, 4, 2)),
           "q2_k": (84, 256, 16, 0, lambda b, blk, path: _groups_k16(b, two_bits(b, blk, 16), *q2_k_coefficients(b, blk))),
           "q3_k": (110, 256, 16, 4, lambda b, blk, path: _groups_k16(b, q3_k_quants(b, blk), q3_k_scales(b, blk), None))}


