"""The int8 row dots (kernels/_simd.py's ``idot_*``) of the low-bit and legacy GGUF formats: q4_0,
q4_1, q5_0 and q5_1 (32-value blocks, eight a step as q8_0's) and q2_k and q3_k (256-value blocks
of sixteen 16-value groups, as q6_k's). Imported by _simd.register beside _simd_int8, whose core
steps (idot, _totals8, k16_sums) they share.

The quants go in unsigned (vpdpbusd's first operand). A format whose value is u - offset takes
the offset off once per 32 or 16 values, offset * xs (qact's s, or its sums16 for the 16-value
groups: xd times the sum of those xq); a format with a min adds min * xs.

Shapes: as kernels/_simd_int8.py (row u8[NB,S]; xq i8[NB,V]; xd f32[NB,V/32]; xs f32[NB,V/32], or
f32[NB,V/16] for q2_k and q3_k).
"""
from llvmlite import ir

from freetoken.kernels import _simd
from freetoken.kernels._simd_int8 import (ZERO8, I8x32, _float, _fma, _fp16_eight, _register_int_row, _totals8,
                                          idot, k16_sums, nibbles)
from freetoken.kernels._simd_ir import F32, I32, I64, _bytes, _fp16, _lanes, _load, _same, _splat

F8, I32x16 = ir.VectorType(F32, 8), ir.VectorType(I32, 16)


def high_bits(builder, block, at):
    """<32 x i8>: 16 in lane j where bit j of the little-endian u32 at byte `at` is set, else 0
    (q5_0's and q5_1's fifth bits): its 4 bytes spread to 8 lanes each, one mask and a compare."""
    spread = _lanes(builder, _bytes(builder, block, at, 4), [j // 8 for j in range(32)])
    bit = ir.Constant(I8x32, [(1 << (j % 8)) - (256 if j % 8 == 7 else 0) for j in range(32)])
    is_set = builder.icmp_unsigned("!=", builder.and_(spread, bit), _same(8, 32, 0))
    return builder.select(is_set, _same(8, 32, 16), _same(8, 32, 0))


def legacy_quants(builder, block, qs_at, qh_at):
    """The 32 unsigned quants <32 x i8> of a q4_0 / q4_1 / q5_0 / q5_1 block in value order: the
    nibbles of the 16 bytes at qs_at, and the fifth bits of the u32 at qh_at (None: 4-bit)."""
    u = nibbles(builder, block, qs_at)
    return u if qh_at is None else builder.or_(u, high_bits(builder, block, qh_at))


def _legacy(stride, qs_at, qh_at, min_at, offset):
    """The (eight blocks, one block) steps of a 32-value format: d fp16 at byte 0, a min fp16 at
    min_at (or None), the 16 bytes of low nibbles at qs_at, the u32 of fifth bits at qh_at (or
    None); its value d * (u - offset) (+ min)."""
    def quants(builder, block):
        return legacy_quants(builder, block, qs_at, qh_at)

    def eight(builder, ptrs, acc, path):
        """acc <8 x float> + eight blocks, block b in lane b: per block d * (xd * (u . xq) -
        offset * xs) (+ min * xs), the 8 integer dots summed across their lanes at once."""
        block, xq, xd, xs = ptrs
        sums = [idot(builder, quants(builder, builder.gep(block, [ir.Constant(I64, stride * b)])),
                     _bytes(builder, xq, 32 * b), ZERO8, path) for b in range(8)]
        xs8 = _load(builder, xs, 0, F8, 4)
        dots = builder.fmul(_float(builder, _totals8(builder, sums, path)), _load(builder, xd, 0, F8, 4))
        if offset:
            dots = _fma(builder, xs8, _splat(builder, ir.Constant(F32, -float(offset)), 8), dots)
        acc = _fma(builder, dots, _fp16_eight(builder, block, stride), acc)
        return acc if min_at is None else _fma(builder, _fp16_eight(builder, block, stride, min_at), xs8, acc)

    def one(builder, ptrs, acc, path):
        """acc + one block (a row's last NB % 8): its integer dot's lanes times d * xd, the
        offset's and the min's terms added in lane 0."""
        block, xq, xd, xs = ptrs
        lanes = _float(builder, idot(builder, quants(builder, block), _bytes(builder, xq, 0), ZERO8, path))
        d, x_s = _fp16(builder, block, 0), _load(builder, xs, 0, F32, 4)
        acc = _fma(builder, lanes, _splat(builder, builder.fmul(d, _load(builder, xd, 0, F32, 4)), 8), acc)
        extra = builder.fmul(builder.fmul(d, ir.Constant(F32, -float(offset))), x_s)
        if min_at is not None:
            extra = builder.fadd(extra, builder.fmul(_fp16(builder, block, min_at), x_s))
        first = builder.fadd(builder.extract_element(acc, ir.Constant(I32, 0)), extra)
        return builder.insert_element(acc, first, ir.Constant(I32, 0))

    return eight, one


def two_bits(builder, block, at):
    """The 8 slices of 32 two-bit quants of a q2_k / q3_k block in value order (gguf-py's): slice
    g is bit pair g & 3 of the 32 bytes at `at` + 32 * (g >> 2)."""
    out = []
    for g in range(8):
        packed = _bytes(builder, block, at + 32 * (g >> 2))
        out.append(builder.and_(builder.lshr(packed, _same(8, 32, 2 * (g & 3))), _same(8, 32, 3)))
    return out


def q2_k_coefficients(builder, block):
    """(d * scale_i, dmin * min_i) <16 x float> of a q2_k block's 16-value groups (the scale in
    the low 4 bits of byte i, the min in the high 4; d, dmin fp16 at 80, 82)."""
    packed, f16 = _bytes(builder, block, 0, 16), ir.VectorType(F32, 16)
    scales, mins = builder.and_(packed, _same(8, 16, 15)), builder.lshr(packed, _same(8, 16, 4))
    return tuple(builder.fmul(builder.uitofp(v, f16), _splat(builder, _fp16(builder, block, at), 16))
                 for v, at in ((scales, 80), (mins, 82)))


def _q2_k(builder, ptrs, acc, path):
    """acc <8 x float> + one q2_k block (quants at 16): per 16-value group d*scale_i * xd * (u .
    xq) - dmin*min_i * xs_i."""
    a16, c16 = q2_k_coefficients(builder, ptrs[0])
    total, offset = k16_sums(builder, ptrs, two_bits(builder, ptrs[0], 16), a16, c16, path)
    return builder.fadd(acc, builder.fsub(total, offset))


def q3_k_scales(builder, block):
    """d * scale_i <16 x float> of a q3_k block: scale_i (6 bits, minus 32) = the low 4 bits from
    nibble i >> 3 of byte 96 + (i & 7), the high 2 from pair i >> 2 of byte 104 + (i & 3). The 12
    scale bytes are loaded alone: 16 would run past the 110-byte block (past a row's end)."""
    raw = builder.zext(_bytes(builder, block, 96, 12), ir.VectorType(I32, 12))
    const = lambda values: ir.Constant(I32x16, list(values))                            # noqa: E731
    low = builder.lshr(_lanes(builder, raw, [i & 7 for i in range(16)]), const(4 * (i >> 3) for i in range(16)))
    high = builder.lshr(_lanes(builder, raw, [8 + (i & 3) for i in range(16)]), const(2 * (i >> 2) for i in range(16)))
    high = builder.shl(builder.and_(high, _same(32, 16, 3)), _same(32, 16, 4))
    six = builder.or_(builder.and_(low, _same(32, 16, 15)), high)
    scales = builder.sitofp(builder.sub(six, _same(32, 16, 32)), ir.VectorType(F32, 16))
    return builder.fmul(scales, _splat(builder, _fp16(builder, block, 108), 16))


def q3_k_quants(builder, block):
    """The 8 slices of 32 unsigned quants (0..7; the value is minus 4) of a q3_k block in value
    order: slice g's two bits from the quants at 32 (two_bits), bit 2 = bit g of hmask byte l."""
    mask = _bytes(builder, block, 0)
    return [builder.or_(u, builder.shl(builder.and_(builder.lshr(mask, _same(8, 32, g)), _same(8, 32, 1)), _same(8, 32, 2)))
            for g, u in enumerate(two_bits(builder, block, 32))]


def _q3_k(builder, ptrs, acc, path):
    """acc <8 x float> + one q3_k block (hmask at 0, quants at 32, scales at 96, d fp16 at 108):
    per 16-value group d*scale_i * (xd * (u . xq) - 4 * xs_i)."""
    a16 = q3_k_scales(builder, ptrs[0])
    total, offset = k16_sums(builder, ptrs, q3_k_quants(builder, ptrs[0]), a16, a16, path)
    return builder.fadd(acc, _fma(builder, offset, _splat(builder, ir.Constant(F32, -4.0), 8), total))


# (block bytes, values, accumulator lanes, values per xs float), as _simd_int8's table; the
# 32-value formats eight blocks a step, as q8_0 (their per-block tails one at a time)
for _plain_dot, _shape, _block in ((_simd.idot_q4_0, (18, 32, 8, 32), _legacy(18, 2, None, None, 8)),
                                   (_simd.idot_q4_1, (20, 32, 8, 32), _legacy(20, 4, None, 2, 0)),
                                   (_simd.idot_q5_0, (22, 32, 8, 32), _legacy(22, 6, 2, None, 16)),
                                   (_simd.idot_q5_1, (24, 32, 8, 32), _legacy(24, 8, 4, 2, 0)),
                                   (_simd.idot_q2_k, (84, 256, 8, 16), _q2_k),
                                   (_simd.idot_q3_k, (110, 256, 8, 16), _q3_k)):
    _register_int_row(_plain_dot, _shape, _block)
