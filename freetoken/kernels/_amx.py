"""AMX-INT8 tiles from numba (LLVM's x86 AMX intrinsics through llvmlite): the tile operations
kernels/qgemm_amx.py's quantized GEMM is made of. Imports numba and llvmlite at the top, so only
qgemm_amx imports it, once the engine has chosen that path.

A core has eight tile registers of up to 16 rows x 64 bytes, shaped by a 64-byte configuration
(``config``) loaded per thread. ``tile_*`` uses two sets of three, so one group's tdpbusd
overlaps the other's scales: C = A (16 weight rows x G unsigned quants) . B (G/4 rows of 16
tokens x 4 signed values: the qgemm tiles' own layout) as 16 x 16 int32 sums, stored to memory,
then the fp32 scales applied with 16-lane vectors; ``unpack_*`` lay a weight row's blocks out as
A's rows.

Linux hands out the tile state only on request (kernels/_isa.py's ``amx_int8`` asks, once per
process); without it a tile instruction faults.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.kernels._simd_ir import _function, _splat
from freetoken.kernels._simd_itile import FORMATS as _FORMATS

I8, I32, I64, F32, VOID = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.VoidType()
I32x16, F32x16 = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
PTR = ir.PointerType(I8)
C_TILE, A_TILE, B_TILE = 0, 2, 4          # the first of each pair


def config(group: int) -> np.ndarray:
    """The 64-byte tile configuration for groups of ``group`` values: palette 1; two each of C
    (16 rows x 64 bytes: 16 int32), A (16 rows x ``group`` bytes) and B (group/4 rows x 64)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for pair in range(2):
        shapes = ((C_TILE + pair, (16, 64)), (A_TILE + pair, (16, group)), (B_TILE + pair, (group // 4, 64)))
        for tile, (rows, width) in shapes:
            cfg[16 + 2 * tile:18 + 2 * tile] = np.frombuffer(np.uint16(width).tobytes(), np.uint8)
            cfg[48 + tile] = rows
    return cfg


def _call(builder, name, params, args):
    builder.call(_function(builder, name, VOID, params), args)


def _data(context, builder, ty, value):
    """An array argument's data pointer as i8*."""
    return builder.bitcast(context.make_array(ty)(context, builder, value).data, PTR)


@intrinsic
def load_config(typingctx, cfg):
    """ldtilecfg: shape this thread's tiles (``config``'s bytes)."""
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [PTR], [_data(context, builder, sig.args[0], args[0])])
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def release(typingctx):
    """tilerelease: this thread is done with its tiles."""
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), codegen


class _Block:
    """One call of a ``tile_*`` intrinsic: its pointers, and the 16 row accumulators (an alloca
    of constant-indexed vectors, which LLVM keeps in registers)."""

    def __init__(self, context, builder, sig, args, G, mins, offset):
        data = lambda i: _data(context, builder, sig.args[i], args[i])
        floats = lambda i, at: builder.gep(builder.bitcast(data(i), F32.as_pointer()), [at])
        self.b, self.G, self.mins, self.offset = builder, G, mins, offset
        self.quants, self.k = data(0), args[1]
        self.xt = builder.gep(data(2), [args[3]])
        self.sums, self.groups = data(4), args[7]
        self.coef_a, self.coef_c = floats(5, ir.Constant(I64, 0)), floats(6, ir.Constant(I64, 0))
        self.xd, self.xs = floats(8, args[9]), floats(10, args[11])
        self.xb = builder.gep(builder.bitcast(data(12), I32.as_pointer()), [args[11]])
        self.out = builder.bitcast(floats(13, ir.Constant(I64, 0)), F32x16.as_pointer())
        self.acc = [cgutils.alloca_once_value(builder, ir.Constant(F32x16, None)) for _ in range(16)]
        self.fma = _function(builder, "llvm.fma.v16f32", F32x16, [F32x16] * 3)

    def dot(self, g, pair):
        """C[pair] = A[pair] . B[pair] for group g (an i64 value)."""
        b, load = self.b, [I8, PTR, I64]
        a_at = b.mul(g, ir.Constant(I64, self.G))
        b_at = b.mul(g, ir.Constant(I64, self.G // 4 * 64))
        _call(b, "llvm.x86.tileloadd64", load, [ir.Constant(I8, A_TILE + pair), b.gep(self.quants, [a_at]), self.k])
        _call(b, "llvm.x86.tileloadd64", load, [ir.Constant(I8, B_TILE + pair), b.gep(self.xt, [b_at]),
                                                ir.Constant(I64, 64)])
        _call(b, "llvm.x86.tilezero", [I8], [ir.Constant(I8, C_TILE + pair)])
        _call(b, "llvm.x86.tdpbusd", [I8, I8, I8], [ir.Constant(I8, C_TILE + pair), ir.Constant(I8, A_TILE + pair),
                                                      ir.Constant(I8, B_TILE + pair)])

    def scale(self, g, pair):
        """acc[r] += float(C[pair][r] + xb) * (a[r, g] * xd) - c[r, g] * xs (the VNNI kernel's
        formula; xb only for formats with an offset, c only for those with mins)."""
        b = self.b
        sums = b.gep(self.sums, [ir.Constant(I64, 1024 * pair)])
        _call(b, "llvm.x86.tilestored64", [I8, PTR, I64], [ir.Constant(I8, C_TILE + pair), sums, ir.Constant(I64, 64)])
        vec = lambda ptr, at, ty: b.load(b.bitcast(b.gep(ptr, [at]), ty.as_pointer()), align=4)
        lane_at = b.mul(g, ir.Constant(I64, 16))
        xd = vec(self.xd, b.mul(b.lshr(b.mul(g, ir.Constant(I64, self.G)), ir.Constant(I64, 5)), ir.Constant(I64, 16)), F32x16)
        xs = vec(self.xs, lane_at, F32x16) if self.mins else None
        xb = vec(self.xb, lane_at, I32x16) if self.offset else None
        for r in range(16):
            total = b.load(b.bitcast(b.gep(sums, [ir.Constant(I64, 64 * r)]), I32x16.as_pointer()), align=4)
            total = b.sitofp(b.add(total, xb) if xb is not None else total, F32x16)
            at = b.add(b.mul(self.groups, ir.Constant(I64, r)), g)
            acc = b.call(self.fma, [total, b.fmul(_splat(b, b.load(b.gep(self.coef_a, [at])), 16), xd),
                                    b.load(self.acc[r])])
            if xs is not None:
                acc = b.fsub(acc, b.fmul(_splat(b, b.load(b.gep(self.coef_c, [at])), 16), xs))
            b.store(acc, self.acc[r])

    def finish(self):
        for r in range(16):
            self.b.store(self.b.load(self.acc[r]), self.b.gep(self.out, [ir.Constant(I64, r)]), align=4)


def _tile_block(G, mins, offset):
    """The intrinsic tile(A, k, xt, b_at, sums, coef_a, coef_c, groups, xd, xd_at, xs, x_at, xb,
    out): 16 weight rows (A u8[16,k], coefficients [16, groups]) against one token tile (xt's
    bytes from b_at; xd, xs, xb from their element offsets) -> out f32[16,16], every group
    of G values: two groups at a time on tile pairs, so one's tdpbusd overlaps the other's
    scales; sums i32[2,16,16] is where C tiles go to memory."""
    def codegen(context, builder, sig, args):
        blk = _Block(context, builder, sig, args, G, mins, offset)
        pairs = builder.udiv(blk.groups, ir.Constant(I64, 2))
        with cgutils.for_range(builder, pairs) as loop:
            g0 = builder.mul(loop.index, ir.Constant(I64, 2))
            g1 = builder.add(g0, ir.Constant(I64, 1))
            blk.dot(g0, 0)
            blk.dot(g1, 1)
            blk.scale(g0, 0)
            blk.scale(g1, 1)
        odd = builder.icmp_unsigned("!=", builder.urem(blk.groups, ir.Constant(I64, 2)), ir.Constant(I64, 0))
        with builder.if_then(odd):
            last = builder.sub(blk.groups, ir.Constant(I64, 1))
            blk.dot(last, 0)
            blk.scale(last, 0)
        blk.finish()
        return context.get_dummy_value()

    @intrinsic
    def tile(typingctx, a, k, xt, b_at, sums, coef_a, coef_c, groups, xd, xd_at, xs, x_at, xb, out):
        i64 = types.int64
        return types.void(a, i64, xt, i64, sums, coef_a, coef_c, i64, xd, i64, xs, i64, xb, out), codegen
    return tile


# per format: (G, mins, offset) as qgemm.GROUPS and the formats' values a*u - c
tile_q8_0, tile_q4_k, tile_q5_k, tile_q6_k = (_tile_block(*f) for f in
                                              ((32, False, True), (32, True, False), (32, True, False), (16, False, True)))


def _unpack(shape):
    """The intrinsic unpack(row u8[NB,S], A u8[R,K], r, coef_a, coef_c f32[R,K/G]): row's blocks
    into A[r] (unsigned quants in value order) and its groups' a and c (values are a*u - c; c
    0 where the format has no mins), with the VNNI kernel's own IR for a block's groups."""
    _, V, G, _, groups_of = shape

    def codegen(context, builder, sig, args):
        row = context.make_array(sig.args[0])(context, builder, args[0])
        nb, stride = builder.extract_value(row.shape, 0), builder.extract_value(row.strides, 0)
        k = builder.mul(nb, ir.Constant(I64, V))
        groups = builder.udiv(k, ir.Constant(I64, G))
        quants = builder.gep(_data(context, builder, sig.args[1], args[1]), [builder.mul(args[2], k)])
        coef = [builder.gep(builder.bitcast(_data(context, builder, sig.args[i], args[i]), F32.as_pointer()),
                            [builder.mul(args[2], groups)]) for i in (3, 4)]
        with cgutils.for_range(builder, nb) as blocks:
            block = builder.gep(builder.bitcast(row.data, PTR), [builder.mul(blocks.index, stride)])
            for gi, (u, a, c) in enumerate(groups_of(builder, block, "vnni")):   # AMX CPUs have VNNI
                at = builder.add(builder.mul(blocks.index, ir.Constant(I64, V)), ir.Constant(I64, gi * G))
                builder.store(u, builder.bitcast(builder.gep(quants, [at]), u.type.as_pointer()), align=1)
                g = builder.add(builder.mul(blocks.index, ir.Constant(I64, V // G)), ir.Constant(I64, gi))
                builder.store(a, builder.gep(coef[0], [g]))
                builder.store(c if c is not None else ir.Constant(F32, 0.0), builder.gep(coef[1], [g]))
        return context.get_dummy_value()

    @intrinsic
    def unpack(typingctx, row, A, r, coef_a, coef_c):
        return types.void(row, A, types.int64, coef_a, coef_c), codegen
    return unpack


unpack_q8_0, unpack_q4_k, unpack_q5_k, unpack_q6_k = (_unpack(_FORMATS[name]) for name in ("q8_0", "q4_k", "q5_k", "q6_k"))
