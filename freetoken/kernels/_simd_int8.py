"""The LLVM IR of kernels/_simd.py's int8 row dots (``idot_*``) and their numba overloads. Imported
only by _simd.register, once numba is loaded.

The core step takes 32 unsigned quants u and 32 signed rounded x values s (kernels/qact.py) and
adds 8 int32 lanes, lane i = sum of u*s over bytes 4i .. 4i+3: one VNNI vpdpbusd; on AVX2 two
instructions (pmaddubsw to int16 pairs, then pmaddwd by ones: no pair overflows int16 here,
|u| <= 128 and |s| <= 127); elsewhere widening multiplies and adds. Every path gives the same
integers; which one is chosen from the features numba compiles for (``dot_path``), once per
compile. The lanes are scaled to fp32 per 32 values (per 16 for q6_k) and carried across blocks
in one fp32 vector, reduced once at the end.

Shapes: row u8[NB,S]; xq i8[NB,V]; xd, xs f32[NB,V/32] (q6_k's xs f32[NB,V/16]); all C-contiguous.
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
from freetoken.kernels._isa import host, int8_dot_path
from freetoken.kernels.qmxfp4 import KVALUES
from freetoken.kernels._simd_ir import (F32, I8, I32, I64, _bytes, _contiguous, _fp16, _function,
                                        _k4_coefficients, _lanes, _load, _same, _splat)

I8x32, I16x16, I32x8 = ir.VectorType(I8, 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(I32, 8)
ZERO8 = ir.Constant(I32x8, None)


def dot_path(features: str) -> str:
    """_isa.int8_dot_path of an LLVM feature string (numba's target machine's: '+avx2,-amx-int8,...')."""
    return int8_dot_path({f[1:] for f in features.split(",") if f.startswith("+")})


def idot(builder, u, s, acc, path):
    """acc <8 x i32> + the 8 sums of 4 products of u <32 x i8> (unsigned) and s (signed)."""
    if path == "vnni":
        vpdpbusd = _function(builder, "llvm.x86.avx512.vpdpbusd.256", I32x8, [I32x8, I8x32, I8x32])
        return builder.call(vpdpbusd, [acc, u, s])
    if path == "avx2":
        pairs = builder.call(_function(builder, "llvm.x86.avx2.pmadd.ub.sw", I16x16, [I8x32, I8x32]), [u, s])
        quads = _function(builder, "llvm.x86.avx2.pmadd.wd", I32x8, [I16x16, I16x16])
        return builder.add(acc, builder.call(quads, [pairs, _same(16, 16, 1)]))
    wide = ir.VectorType(I32, 32)
    products = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    for j in range(4):
        acc = builder.add(acc, _lanes(builder, products, range(j, 32, 4)))
    return acc


def _fma(builder, a, b, c):
    vec = a.type
    return builder.call(_function(builder, f"llvm.fma.v{vec.count}f32", vec, [vec] * 3), [a, b, c])


def _float(builder, ints):
    return builder.sitofp(ints, ir.VectorType(F32, ints.type.count))


def _signed_dot(builder, k, x, path, psign):
    """<8 x i32> lane sums of k <32 x i8> (signed, |k| <= 127) times x (signed): |k| against x with
    k's sign moved onto it (vpdpbusd wants one operand unsigned), by vpsignb when psign (AVX2: one
    instruction; measured faster only in _q8_0_eight's loop, slower in the block-at-a-time one
    on the Zen 4 VM) or a compare and a masked subtract."""
    absolute = _function(builder, "llvm.abs.v32i8", I8x32, [I8x32, ir.IntType(1)])
    u = builder.call(absolute, [k, ir.Constant(ir.IntType(1), 0)])
    if psign and path in ("vnni", "avx2"):     # x negated where k < 0, zeroed where k = 0 (|k| is 0 there)
        s = builder.call(_function(builder, "llvm.x86.avx2.psign.b", I8x32, [I8x32, I8x32]), [x, k])
    else:
        s = builder.select(builder.icmp_signed("<", k, ir.Constant(I8x32, None)), builder.neg(x), x)
    return idot(builder, u, s, ZERO8, path)


def _q8_0_parts(builder, block, xq, path):
    """(the <8 x i32> lane sums of q * xq, d) of one q8_0 block (d fp16 at byte 0, q at 2)."""
    return _signed_dot(builder, _bytes(builder, block, 2), _bytes(builder, xq, 0), path, False), _fp16(builder, block, 0)


def _mxfp4_parts(builder, block, xq, path):
    """(the lane sums of k * xq, 2**(e - 128)) of one mxfp4 block: k the doubled e2m1 values."""
    k = _kvalues(builder, mxfp4_codes(builder, block), path)
    return _signed_dot(builder, k, _bytes(builder, xq, 0), path, False), mxfp4_half_scale(builder, block)


def _one_block(parts):
    """acc <8 x float> + one 32-value block: its scale * xd * (its integer dot)."""
    def block_lanes(builder, ptrs, acc, path):
        block, xq, xd, _ = ptrs
        ints, scale = parts(builder, block, xq, path)
        scale = builder.fmul(scale, _load(builder, xd, 0, F32, 4))
        return _fma(builder, _float(builder, ints), _splat(builder, scale, 8), acc)
    return block_lanes


def _q8_0_eight(builder, ptrs, acc, path):
    """acc <8 x float> + eight q8_0 blocks, block b in lane b: each block's integer dot summed
    across its lanes first (_totals8), then one multiply-add for the eight (their d * xd), the 8
    d read by one shuffle (_fp16_eight). On VNNI the quants go in plus 128 (unsigned: one vpxor
    for vpdpbusd's first operand instead of vpabsb and vpsignb), the offset taken off per block as
    128 * xs (qact's s, xd * sum(xq)); pmaddubsw's int16 pairs would overflow at 255 * 127 * 2,
    so AVX2 moves q's sign onto x."""
    block, xq, xd, xs = ptrs
    sums = []
    for b in range(8):
        q, x = _bytes(builder, block, 34 * b + 2), _bytes(builder, xq, 32 * b)
        if path == "vnni":
            sums.append(idot(builder, builder.xor(q, _same(8, 32, -128)), x, ZERO8, path))
        else:
            sums.append(_signed_dot(builder, q, x, path, psign=True))
    f8 = ir.VectorType(F32, 8)
    dots = builder.fmul(_float(builder, _totals8(builder, sums, path)), _load(builder, xd, 0, f8, 4))
    if path == "vnni":
        dots = builder.fsub(dots, builder.fmul(_load(builder, xs, 0, f8, 4), _splat(builder, ir.Constant(F32, 128.0), 8)))
    return _fma(builder, dots, _fp16_eight(builder, block, 34), acc)


def _fp16_eight(builder, block, stride, at=0):
    """The fp16 at bytes at, at + stride, .., at + 7 * stride of block (stride and at even, at <
    stride < 36) as <8 x float>: one shuffle of the eight blocks' words (at most 128; never past
    the eighth block's end) and one vcvtph2ps where the target has F16C (vpermi2w on AVX512BW),
    else one at a time (_fp16)."""
    if "f16c" not in host()[1]:
        out = ir.Constant(ir.VectorType(F32, 8), None)
        for b in range(8):
            out = builder.insert_element(out, _fp16(builder, block, at + stride * b), ir.Constant(I32, b))
        return out
    words = _load(builder, block, 0, ir.VectorType(ir.IntType(16), min(128, 4 * stride)), 1)
    picks = range(at // 2, at // 2 + 4 * stride, stride // 2)
    return builder.fpext(builder.bitcast(_lanes(builder, words, picks), ir.VectorType(ir.HalfType(), 8)),
                         ir.VectorType(F32, 8))


def _kvalues(builder, codes, path, offset=0):
    """The doubled e2m1 values (signed) of 32 codes 0..15, plus offset: one vpshufb table lookup on
    the AVX2 and VNNI paths; elsewhere from the bits (m = code & 7: m below 4, else (2 + (m & 1)) <<
    (1 + ((m >> 1) & 1)), negated when bit 3 is set)."""
    if path in ("vnni", "avx2"):
        pshufb = _function(builder, "llvm.x86.avx2.pshuf.b", I8x32, [I8x32, I8x32])
        return builder.call(pshufb, [ir.Constant(I8x32, [int(v) + offset for v in KVALUES] * 2), codes])
    if offset:
        return builder.add(_kvalues(builder, codes, path), _same(8, 32, offset))
    m = builder.and_(codes, _same(8, 32, 7))
    odd = builder.add(_same(8, 32, 2), builder.and_(m, _same(8, 32, 1)))
    big = builder.select(builder.icmp_unsigned(">", m, _same(8, 32, 5)), builder.shl(odd, _same(8, 32, 2)),
                         builder.shl(odd, _same(8, 32, 1)))
    k = builder.select(builder.icmp_unsigned("<", m, _same(8, 32, 4)), m, big)
    return builder.select(builder.icmp_unsigned(">", codes, _same(8, 32, 7)), builder.neg(k), k)


def mxfp4_codes(builder, block):
    """An mxfp4 block's 32 codes <32 x i8> in value order: nibbles(block, 1)."""
    return nibbles(builder, block, 1)


def nibbles(builder, block, at):
    """The 32 nibbles of the 16 bytes at byte `at` of block as <32 x i8>, in value order (low
    nibbles, then high: mxfp4's, q4_0's and q4_1's, q5_0's and q5_1's low four bits): the 16
    bytes read into both 128-bit halves (one broadcast load), the upper half shifted right by 4
    (one variable dword shift, vpsrlvd), one mask. Masking and shifting a half each and joining them
    took two instructions more on the Zen 4 VM (bench/kernels/quant_dots.py --formats mxfp4, old
    and new alternating 3 rounds: in cache 34.8-41.4 against 30.0-37.0 G weights/s, from memory
    43.1-50.5 against 33.0-46.1)."""
    codes = _bytes(builder, block, at, 16)
    both = builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(I32, 32), list(range(16)) * 2))
    shifted = builder.lshr(builder.bitcast(both, I32x8), ir.Constant(I32x8, [0] * 4 + [4] * 4))
    return builder.and_(builder.bitcast(shifted, I8x32), _same(8, 32, 15))


MXFP4_OFFSET = 12      # -min(KVALUES): the values plus this are unsigned, vpdpbusd's first operand


def _mxfp4_eight(builder, ptrs, acc, path):
    """acc <8 x float> + eight mxfp4 blocks, block b in lane b: u = the doubled e2m1 values + 12
    (unsigned: one vpdpbusd a block, no sign moved onto x), each block's integer dot summed across
    its lanes (_totals8), then per block 2**(e - 128) * (xd * (u . xq) - 12 * xs), xs = xd *
    sum(xq) (qact's s): the offset taken off once per block, the scales built as one vector from
    the 8 exponent bytes picked out of the 136 bytes by one shuffle (vpermi2b with VBMI; inserting
    them one by one was ~15% of experts_quant's _decode at one token, Zen 4 VM)."""
    block, xq, xd, xs = ptrs
    sums = []
    for b in range(8):
        at = builder.gep(block, [ir.Constant(I64, 17 * b)])
        u = _kvalues(builder, mxfp4_codes(builder, at), path, MXFP4_OFFSET)
        sums.append(idot(builder, u, _bytes(builder, xq, 32 * b), ZERO8, path))
    exps = builder.zext(_lanes(builder, _bytes(builder, block, 0, 128), range(0, 136, 17)), I32x8)
    f8 = ir.VectorType(F32, 8)
    dots = builder.fmul(_float(builder, _totals8(builder, sums, path)), _load(builder, xd, 0, f8, 4))
    offsets = builder.fmul(_load(builder, xs, 0, f8, 4), _splat(builder, ir.Constant(F32, float(MXFP4_OFFSET)), 8))
    return _fma(builder, builder.fsub(dots, offsets), _half_scales(builder, exps), acc)


def _half_scales(builder, e):
    """mxfp4_half_scale of 8 exponents <8 x i32> at once."""
    small = builder.shl(_same(32, 8, 0x00200000), e)
    big = builder.shl(builder.sub(e, _same(32, 8, 1)), _same(32, 8, 23))
    bits = builder.select(builder.icmp_unsigned("<", e, _same(32, 8, 2)), small, big)
    return builder.bitcast(bits, ir.VectorType(F32, 8))


def mxfp4_half_scale(builder, block):
    """2**(e - 128) (half the block's scale: the values are doubled), float, from e's bits."""
    e = builder.zext(_load(builder, block, 0, I8, 1), I32)
    small = builder.shl(ir.Constant(I32, 0x00200000), e)
    bits = builder.select(builder.icmp_unsigned("<", e, ir.Constant(I32, 2)), small,
                          builder.shl(builder.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23)))
    return builder.bitcast(bits, F32)


def _hadd(builder, a, b, path):
    """<8 x i32> [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] (vphaddd's order)."""
    if path in ("vnni", "avx2"):
        return builder.call(_function(builder, "llvm.x86.avx2.phadd.d", I32x8, [I32x8, I32x8]), [a, b])
    picks = lambda first: ir.Constant(I32x8, [first + i for i in (0, 2, 8, 10, 4, 6, 12, 14)])   # noqa: E731
    return builder.add(builder.shuffle_vector(a, b, picks(0)), builder.shuffle_vector(a, b, picks(1)))


def _totals8(builder, sums, path):
    """The 8 lane sums of 8 <8 x i32> vectors, in one <8 x i32> (lane j: sums[j]'s total): two
    levels of horizontal adds, then the two 128-bit halves added."""
    pairs = [_hadd(builder, sums[i], sums[i + 1], path) for i in range(0, 8, 2)]
    quads = [_hadd(builder, pairs[0], pairs[1], path), _hadd(builder, pairs[2], pairs[3], path)]
    low = builder.shuffle_vector(quads[0], quads[1], ir.Constant(I32x8, [0, 1, 2, 3, 8, 9, 10, 11]))
    high = builder.shuffle_vector(quads[0], quads[1], ir.Constant(I32x8, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(low, high)


def _k45(builder, ptrs, acc, path, qh_at, qs_at):
    """acc <8 x float> + one q4_k / q5_k block: lane j, sub-block j's a_j * xd_j * (u . xq) minus
    c_j * xs_j. The 32 products of a sub-block are summed as integers first (exact), so each
    sub-block takes one fp32 multiply-add, not eight."""
    block, xq, xd, xs = ptrs
    a8, c8 = _k4_coefficients(builder, block)
    f8 = ir.VectorType(F32, 8)
    high_bits = _bytes(builder, block, qh_at) if qh_at is not None else None
    sums = []
    for p in range(4):
        quants = _bytes(builder, block, qs_at + 32 * p)
        for half, u in enumerate((builder.and_(quants, _same(8, 32, 15)), builder.lshr(quants, _same(8, 32, 4)))):
            j = 2 * p + half
            if high_bits is not None:
                bit = builder.and_(builder.lshr(high_bits, _same(8, 32, j)), _same(8, 32, 1))
                u = builder.or_(u, builder.shl(bit, _same(8, 32, 4)))
            sums.append(idot(builder, u, _bytes(builder, xq, 32 * j), ZERO8, path))
    ax = builder.fmul(a8, _load(builder, xd, 0, f8, 4))
    mins = builder.fmul(c8, _load(builder, xs, 0, f8, 4))
    return builder.fadd(acc, builder.fsub(builder.fmul(_float(builder, _totals8(builder, sums, path)), ax), mins))


def _q4_k(builder, ptrs, acc, path):
    return _k45(builder, ptrs, acc, path, None, 16)


def _q5_k(builder, ptrs, acc, path):
    return _k45(builder, ptrs, acc, path, 16, 48)


def _q6_k_slices(builder, block, n):
    """The 4 slices of 32 unsigned quants (0..63; the value is minus 32) of half n of a q6_k
    block, in gguf-py's order: low 4 bits from ql, high 2 from qh."""
    lo, hi, h = _bytes(builder, block, 64 * n), _bytes(builder, block, 64 * n + 32), _bytes(builder, block, 128 + 32 * n)
    four, out = _same(8, 32, 4), []
    for low, shift in ((lo, 0), (hi, 2), (builder.lshr(lo, four), 4), (builder.lshr(hi, four), 6)):
        top = builder.shl(builder.and_(builder.lshr(h, _same(8, 32, shift)), _same(8, 32, 3)), four)
        out.append(builder.or_(builder.and_(low, _same(8, 32, 15)), top))
    return out


def _q6_k(builder, ptrs, acc, path):
    """acc <8 x float> + one q6_k block: per 16 values, d * scale_i * xd * (u . xq), less the
    offset of the quants, 32 * d * scale_i * xs_i (xs: qact.sums16, xd times the sum of those 16
    xq); each 16 values' products summed as integers first (k16_sums)."""
    block, xq, xd, xs = ptrs
    a16 = builder.fmul(_float(builder, _bytes(builder, block, 192, 16)), _splat(builder, _fp16(builder, block, 208), 16))
    slices = [u for n in range(2) for u in _q6_k_slices(builder, block, n)]
    total, offset = k16_sums(builder, ptrs, slices, a16, a16, path)
    return builder.fadd(acc, _fma(builder, offset, _splat(builder, ir.Constant(F32, -32.0), 8), total))


def k16_sums(builder, ptrs, slices, a16, c16, path):
    """(total, offset) <8 x float> of a block of sixteen 16-value groups (q2_k, q3_k, q6_k): the
    unsigned quants in 8 slices of 32 (value order) dotted with xq as exact integers, total =
    sum over groups i of a16_i * xd * (integer sum of group i), offset = sum of c16_i * xs_i (xs
    per 16 values, qact.sums16). The two levels of _totals8's adds leave slice g's two halves in
    lanes g and g + 4 of a 128-bit half, so lanes hold the groups in the order GROUPS16 (then + 8
    for the second vector)."""
    _, xq, xd, xs = ptrs
    xd8 = _load(builder, xd, 0, ir.VectorType(F32, 8), 4)
    offsets = builder.fmul(c16, _load(builder, xs, 0, ir.VectorType(F32, 16), 4))
    sums = [idot(builder, u, _bytes(builder, xq, 32 * g), ZERO8, path) for g, u in enumerate(slices)]
    pairs = [_hadd(builder, sums[i], sums[i + 1], path) for i in range(0, 8, 2)]
    total, offset = None, None
    for v in range(2):
        groups = [8 * v + i for i in GROUPS16]
        ints = _hadd(builder, pairs[2 * v], pairs[2 * v + 1], path)
        scale = builder.fmul(_lanes(builder, a16, groups), _lanes(builder, xd8, [i // 2 for i in groups]))
        term, off = builder.fmul(_float(builder, ints), scale), _lanes(builder, offsets, groups)
        total = term if total is None else builder.fadd(total, term)
        offset = off if offset is None else builder.fadd(offset, off)
    return total, offset


GROUPS16 = (0, 2, 4, 6, 1, 3, 5, 7)    # the 16-value group in each lane of k16_sums' vectors of totals


def _int_row(context, builder, sig, args, shape, block_lanes):
    """The row's blocks folded by block_lanes(builder, (block, xq, xd, xs pointers), acc, path),
    one fp32 vector of `lanes` carried across blocks and reduced once. block_lanes is one function
    or (eight blocks at a time, the last NB % 8 one at a time)."""
    block_bytes, values, lanes, xs_values = shape
    eight, one = block_lanes if isinstance(block_lanes, tuple) else (None, block_lanes)
    arrays = [context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args)]
    path, vec = dot_path(context.codegen()._tm_features), ir.VectorType(F32, lanes)
    acc = cgutils.alloca_once_value(builder, ir.Constant(vec, None))

    def fold(index, lanes_of):
        ptrs = [builder.gep(a.data, [builder.mul(index, ir.Constant(I64, n))])
                for a, n in zip(arrays, (block_bytes, values, values // 32, values // xs_values))]
        builder.store(lanes_of(builder, ptrs, builder.load(acc), path), acc)

    blocks, done = builder.extract_value(arrays[0].shape, 0), ir.Constant(I64, 0)
    if eight is not None:
        steps = builder.sdiv(blocks, ir.Constant(I64, 8))
        with cgutils.for_range(builder, steps) as loop:
            fold(builder.mul(loop.index, ir.Constant(I64, 8)), eight)
        done = builder.mul(steps, ir.Constant(I64, 8))
    with cgutils.for_range(builder, builder.sub(blocks, done)) as loop:
        fold(builder.add(done, loop.index), one)
    total = _function(builder, f"llvm.vector.reduce.fadd.v{lanes}f32", F32, [F32, vec])
    return builder.call(total, [ir.Constant(F32, 0.0), builder.load(acc)], fastmath=("reassoc",))


def _register_int_row(plain, shape, block_lanes):
    """`plain(row, xq, xd, xs)` compiles to the int8 loop; a strided argument (a row of a strided
    expert slot view) is copied contiguous first."""
    @intrinsic
    def int_row(typingctx, row, xq, xd, xs):
        def codegen(context, builder, sig, args):
            return _int_row(context, builder, sig, args, shape, block_lanes)
        ok = (_contiguous(row, xq, xd, xs) and row.dtype == types.uint8 and xq.dtype == types.int8
              and xd.dtype == types.float32 and xs.dtype == types.float32)
        return (types.float32(row, xq, xd, xs), codegen) if ok else None

    @overload(plain, inline="always")
    def _plain(row, xq, xd, xs):
        if _contiguous(row, xq, xd, xs):
            return lambda row, xq, xd, xs: int_row(row, xq, xd, xs)
        return lambda row, xq, xd, xs: int_row(np.ascontiguousarray(row), np.ascontiguousarray(xq),
                                               np.ascontiguousarray(xd), np.ascontiguousarray(xs))


# (block bytes, values, accumulator lanes, values per xs float: 16 for q6_k, qact.sums16)
# q8_0 eight blocks a step (bench/kernels/quant_dots.py, 1024x1024, one thread, Zen 4 VM: int8
# 23.4-23.6 -> 24.7-24.9 G weights/s; with the offset and the one-shuffle scales, 2 threads, 3
# rounds alternating: 46.7-51.4 against 34.0-44.3); mxfp4 eight too, the rest one at a time
_Q8_0, _MXFP4 = (_q8_0_eight, _one_block(_q8_0_parts)), (_mxfp4_eight, _one_block(_mxfp4_parts))
for _plain_dot, _shape, _block in ((_simd.idot_q8_0, (34, 32, 8, 32), _Q8_0), (_simd.idot_q4_k, (144, 256, 8, 32), _q4_k),
                                   (_simd.idot_q5_k, (176, 256, 8, 32), _q5_k), (_simd.idot_q6_k, (210, 256, 8, 16), _q6_k),
                                   (_simd.idot_mxfp4, (17, 32, 8, 32), _MXFP4)):
    _register_int_row(_plain_dot, _shape, _block)
