"""The LLVM IR of kernels/_simd.py's ``idot_q4_0x16``: 16 q4_0 rows interleaved as
kernels/qlayout.py lays them out, against one rounded x. Imported only by _simd.register.

Per block column b: each of the x block's eight 4-byte words is broadcast to all lanes; the 32
bytes at 32 + 64c (+ 32 for rows 8 .. 15) hold word c of 8 rows, so one int8 dot (qact's: VNNI
vpdpbusd, AVX2's pairwise multiply-adds, or widening multiplies) of their low nibbles by word c
and one of their high nibbles by word 4 + c add row j's partial sums into lane j. After four
such pairs lane j holds row j's exact sum(u * xq) for the block: scaled by the 8 rows' d (one
load) and xd, with d * xs carried apart for the offset 8, as idot_q4_0 does row by row.

Shapes: entries u8[NB,288]; xq i8[NB,32]; xd, xs f32[NB,1]; out f32[16] (any stride).
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
from freetoken.kernels._isa import host
from freetoken.kernels._simd_int8 import I8x32, ZERO8, _fma, _float, dot_path, idot
from freetoken.kernels._simd_ir import F32, I32, I64, _bytes, _contiguous, _fp16, _load, _same, _splat
from freetoken.kernels.qlayout import ENTRY, QS_AT

F8 = ir.VectorType(F32, 8)


def _scales(builder, entries, half):
    """<8 x float>: the fp16 d of rows 8*half .. 8*half + 7 (one load and vcvtph2ps with F16C)."""
    at = 16 * half
    if "f16c" in host()[1]:
        return builder.fpext(_load(builder, entries, at, ir.VectorType(ir.HalfType(), 8), 2), F8)
    out = ir.Constant(F8, None)
    for j in range(8):
        out = builder.insert_element(out, _fp16(builder, entries, at + 2 * j), ir.Constant(I32, j))
    return out


def _column(builder, ptrs, sums, path):
    """sums: [acc0, off0, acc1, off1] (<8 x float>, rows 0-7 and 8-15) plus one block column."""
    entries, xq, xd, xs = ptrs
    words = [builder.bitcast(_splat(builder, _load(builder, xq, 4 * c, I32, 1), 8), I8x32) for c in range(8)]
    x_d, x_s = (_splat(builder, _load(builder, p, 0, F32, 4), 8) for p in (xd, xs))
    out = []
    for half in (0, 1):
        ints = ZERO8
        for c in range(4):
            q = _bytes(builder, entries, QS_AT + 64 * c + 32 * half)
            ints = idot(builder, builder.and_(q, _same(8, 32, 15)), words[c], ints, path)
            ints = idot(builder, builder.lshr(q, _same(8, 32, 4)), words[4 + c], ints, path)
        d = _scales(builder, entries, half)
        acc, off = sums[2 * half], sums[2 * half + 1]
        out += [_fma(builder, builder.fmul(_float(builder, ints), x_d), d, acc), _fma(builder, d, x_s, off)]
    return out


def _group_dot(context, builder, sig, args):
    """The column loop, then out[j] = acc - 8 * off per row (stored at out's stride)."""
    entries, xq, xd, xs, out = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
    path = dot_path(context.codegen()._tm_features)
    slots = [cgutils.alloca_once_value(builder, ir.Constant(F8, None)) for _ in range(4)]
    with cgutils.for_range(builder, builder.extract_value(entries.shape, 0)) as loop:
        ptrs = [builder.gep(a.data, [builder.mul(loop.index, ir.Constant(I64, n))])
                for a, n in zip((entries, xq, xd, xs), (ENTRY, 32, 1, 1))]
        for slot, value in zip(slots, _column(builder, ptrs, [builder.load(s) for s in slots], path)):
            builder.store(value, slot)
    stride = builder.extract_value(out.strides, 0)
    base = builder.bitcast(out.data, ir.IntType(8).as_pointer())
    for half in (0, 1):
        acc, off = builder.load(slots[2 * half]), builder.load(slots[2 * half + 1])
        rows = _fma(builder, off, _splat(builder, ir.Constant(F32, -8.0), 8), acc)
        for j in range(8):
            at = builder.gep(base, [builder.mul(ir.Constant(I64, 8 * half + j), stride)])
            builder.store(builder.extract_element(rows, ir.Constant(I32, j)), builder.bitcast(at, F32.as_pointer()))
    return context.get_dummy_value()


def _unpack_row(context, builder, sig, args):
    """Per block column b: row j's four words gathered into its 16 GGUF quant bytes, their low
    and high nibbles stored as u[32b .. 32b + 32] (values in order), a[b] its fp16 d, c[b] 0."""
    arrays = zip((sig.args[0], *sig.args[2:]), (args[0], *args[2:]))
    entries, u, a, c = (context.make_array(t)(context, builder, v) for t, v in arrays)
    j = context.cast(builder, args[1], sig.args[1], types.int64)
    i8x16, i32x4 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(I32, 4)
    with cgutils.for_range(builder, builder.extract_value(entries.shape, 0)) as loop:
        entry = builder.gep(entries.data, [builder.mul(loop.index, ir.Constant(I64, ENTRY))])
        quads = ir.Constant(i32x4, None)
        for col in range(4):
            at = builder.gep(entry, [builder.add(builder.mul(j, ir.Constant(I64, 4)), ir.Constant(I64, QS_AT + 64 * col))])
            quads = builder.insert_element(quads, _load(builder, at, 0, I32, 1), ir.Constant(I32, col))
        q = builder.bitcast(quads, i8x16)
        low, high = builder.and_(q, _same(8, 16, 15)), builder.lshr(q, _same(8, 16, 4))
        quants = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
        builder.store(quants, builder.bitcast(builder.gep(u.data, [builder.mul(loop.index, ir.Constant(I64, 32))]),
                                              I8x32.as_pointer()), align=1)
        scale = _fp16(builder, builder.gep(entry, [builder.mul(j, ir.Constant(I64, 2))]), 0)
        builder.store(scale, builder.gep(a.data, [loop.index]))
        builder.store(ir.Constant(F32, 0.0), builder.gep(c.data, [loop.index]))
    return context.get_dummy_value()


@intrinsic
def _unpack_group_row(typingctx, entries, j, u, a, c):
    ok = (_contiguous(entries, u, a, c) and entries.dtype == types.uint8 and entries.ndim == 2
          and isinstance(j, types.Integer) and u.dtype == types.uint8 and a.dtype == c.dtype == types.float32)
    return (types.void(entries, j, u, a, c), _unpack_row) if ok else None


@overload(_simd.unpack_q4_0x16, inline="always")
def _unpack_q4_0x16(entries, j, u, a, c):
    if _contiguous(entries, u, a, c):
        return lambda entries, j, u, a, c: _unpack_group_row(entries, j, u, a, c)
    return lambda entries, j, u, a, c: _unpack_group_row(np.ascontiguousarray(entries), j, u, a, c)


@intrinsic
def _idot_group(typingctx, entries, xq, xd, xs, out):
    ok = (_contiguous(entries, xq, xd, xs) and entries.dtype == types.uint8 and entries.ndim == 2
          and xq.dtype == types.int8 and xd.dtype == types.float32 and xs.dtype == types.float32
          and isinstance(out, types.Array) and out.dtype == types.float32 and out.ndim == 1)
    return (types.void(entries, xq, xd, xs, out), _group_dot) if ok else None


@overload(_simd.idot_q4_0x16, inline="always")
def _idot_q4_0x16(entries, xq, xd, xs, out):
    if _contiguous(entries, xq, xd, xs):
        return lambda entries, xq, xd, xs, out: _idot_group(entries, xq, xd, xs, out)
    return lambda entries, xq, xd, xs, out: _idot_group(np.ascontiguousarray(entries), np.ascontiguousarray(xq),
                                                        np.ascontiguousarray(xd), np.ascontiguousarray(xs), out)
