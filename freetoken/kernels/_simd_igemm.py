"""The LLVM IR of kernels/_simd.py's int8 tile GEMM (``unpack_*``, ``igemm_g*``) and their numba
overloads: quantized weight rows against tiles of 16 tokens. Imported only by _simd.register, once
numba is loaded.

Lanes are tokens, not positions: a tile holds 16 tokens' rounded activations (kernels/qact.py)
interleaved 4 values at a time, so xt[n, v/4] is 64 bytes, token l's values v .. v+3 at bytes
4l .. 4l+3. One vpdpbusd multiplies 4 of a row's (unsigned) quants, the same 4 in every lane, by
those 4 values of 16 tokens and adds 16 int32 sums: a group's sums come out one per token with no
horizontal reduction. This is what makes prefill of a quantized file an integer GEMM rather than
dequantize-then-fp32-BLAS.

Two steps. ``unpack_<format>`` writes a row's quants as bytes u (one per value) and each group's
a and c, once per row for all of its tiles. ``igemm_g<G>`` then multiplies 4 such rows by 1 or 2
tiles with 8 accumulators in registers: each 4-byte word of u is broadcast straight from memory
(no shuffle) and feeds every tile, each 64 bytes of a tile feed 4 rows. Unpacking inside the
products (once per row and tile, broadcasts by shuffles) ran at 35% of this box's vpdpbusd rate;
this at 50-60% (1.5-1.9x, the same sums: EPYC Zen 4 VM, docs/performance.md).

Per group of G values (32; 16 for q2_k, q3_k and q6_k) a format's values are a*u - c: u the
unsigned quant (q8_0 stores it signed: u = q + 128; mxfp4's doubled e2m1 values -12..12 + 12), a
and c fp32 per group. The integer sum starts from the tile's xb = -off * sum(xq) (off: 128 for
q8_0, 32 for q6_k, 12 for mxfp4, 8 for q4_0, 16 for q5_0, 4 for q3_k, else 0) so sum(u*xq) + xb
is the exact sum((u - off) * xq); then acc += a * xd * sum, and for formats with mins (q4_k,
q5_k, q2_k; q4_1 and q5_1 add theirs: c = -min) acc -= c * xs with xs = xd * sum(xq). Same spec
and tolerance as the GEMV dots: the dequantized row against the rounded x (q * xd), fp32 math in
another order.

Shapes: row u8[NB,S]; u u8[RR,K], a and c f32[RR,K/G] (RR unpacked rows); xt i8[N,K/4,16,4];
xd f32[N,K/32,16]; xs f32[N,K/G,16]; xb i32[N,K/G,16]; out f32[4*TT,16] (row r0 + j against tile
t0 + t at j*TT + t, TT = 1 or 2); all C-contiguous but row, K = NB*V.
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
from freetoken.kernels._simd_ir import F32, I32, I64, _contiguous, _function, _splat
from freetoken.kernels._simd_itile import F32x16, FORMATS, I8x64, I32x16, LANES, _vnni16, tile_path

ROWS = 4                     # weight rows a call: 4 x 2 accumulators, each broadcast word feeds 2 tiles


def _at(builder, base, index, ty):
    """Pointer to a `ty` at element `index` of base."""
    return builder.bitcast(builder.gep(base, [index]), ty.as_pointer())


def _unpack(context, builder, sig, args, shape):
    """u[g*G .. g*G + G] = group g's quants, a[g], c[g] (0 where the format has no mins)."""
    row, u, a, c = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args))
    _, V, G, _, groups_of = shape
    path, per_block = tile_path(context.codegen()._tm_features), ir.Constant(I64, V // G)
    with cgutils.for_range(builder, builder.extract_value(row.shape, 0)) as blocks:
        block = builder.gep(row.data, [builder.mul(blocks.index, builder.extract_value(row.strides, 0))])
        for j, (quants, scale, low) in enumerate(groups_of(builder, block, path)):
            g = builder.add(builder.mul(blocks.index, per_block), ir.Constant(I64, j))
            builder.store(quants, _at(builder, u.data, builder.mul(g, ir.Constant(I64, G)), quants.type), align=1)
            builder.store(scale, builder.gep(a.data, [g]))
            builder.store(ir.Constant(F32, 0.0) if low is None else low, builder.gep(c.data, [g]))
    return context.get_dummy_value()


class _Operands:
    """The arrays of one igemm call and the address of each operand in group g."""

    def __init__(self, context, builder, sig, args, G):
        arrays = [context.make_array(t)(context, builder, v) if isinstance(t, types.Array) else v
                  for t, v in zip(sig.args, args)]
        u, a, c, xt, xd, xs, xb, self.r0, self.t0, self.has_min, out = arrays
        self.u, self.a, self.c, self.xt, self.xd, self.xs, self.xb, self.out = (
            x.data for x in (u, a, c, xt, xd, xs, xb, out))
        self.b, self.G, self.k = builder, G, builder.extract_value(u.shape, 1)
        self.groups = builder.udiv(self.k, ir.Constant(I64, G))

    def tile_vec(self, name, t, index, per_row, width, ty):
        """Tile t0 + t's vector at `index` of its rows of `per_row` vectors of `width` elements."""
        b = self.b
        row = b.add(b.mul(b.add(self.t0, ir.Constant(I64, t)), per_row), index)
        return b.load(_at(b, getattr(self, name), b.mul(row, ir.Constant(I64, width)), ty), align=4)

    def group_scalar(self, name, j, g):
        b = self.b
        return b.load(b.gep(getattr(self, name), [b.add(b.mul(b.add(self.r0, ir.Constant(I64, j)), self.groups), g)]))


def _group_sums(op, tiles, g, path):
    """The 16 exact integer sums of group g of rows r0 .. r0+3 against each tile, xb included."""
    b, G = op.b, op.G
    sums = [[op.tile_vec("xb", t, g, op.groups, LANES, I32x16) for t in range(tiles)] for _ in range(ROWS)]
    for i in range(G // 4):
        step = b.add(b.mul(g, ir.Constant(I64, G // 4)), ir.Constant(I64, i))
        xs = [op.tile_vec("xt", t, step, b.udiv(op.k, ir.Constant(I64, 4)), 64, I8x64) for t in range(tiles)]
        for j in range(ROWS):
            at = b.add(b.mul(b.add(op.r0, ir.Constant(I64, j)), op.k), b.mul(step, ir.Constant(I64, 4)))
            word = b.bitcast(_splat(b, b.load(_at(b, op.u, at, I32), align=1), LANES), I8x64)
            for t in range(tiles):
                sums[j][t] = _vnni16(b, sums[j][t], word, xs[t], path)
    return sums


def _products(op, tiles, with_mins, path):
    """out[j*tiles + t] = row r0 + j against tile t0 + t."""
    b, fma = op.b, _function(op.b, "llvm.fma.v16f32", F32x16, [F32x16] * 3)
    accs = [[cgutils.alloca_once_value(b, ir.Constant(F32x16, None)) for _ in range(tiles)] for _ in range(ROWS)]
    with cgutils.for_range(b, op.groups) as loop:
        g = loop.index
        sums = _group_sums(op, tiles, g, path)
        at32 = b.udiv(b.mul(g, ir.Constant(I64, op.G)), ir.Constant(I64, 32))
        xd = [op.tile_vec("xd", t, at32, b.udiv(op.k, ir.Constant(I64, 32)), LANES, F32x16) for t in range(tiles)]
        xs = [op.tile_vec("xs", t, g, op.groups, LANES, F32x16) for t in range(tiles)] if with_mins else None
        for j in range(ROWS):
            a = _splat(b, op.group_scalar("a", j, g), LANES)
            c = _splat(b, op.group_scalar("c", j, g), LANES) if with_mins else None
            for t in range(tiles):
                acc = b.call(fma, [b.sitofp(sums[j][t], F32x16), b.fmul(a, xd[t]), b.load(accs[j][t])])
                b.store(b.fsub(acc, b.fmul(c, xs[t])) if with_mins else acc, accs[j][t])
    for j in range(ROWS):
        for t in range(tiles):
            b.store(b.load(accs[j][t]), _at(b, op.out, ir.Constant(I64, (j * tiles + t) * LANES), F32x16), align=4)


def _igemm(context, builder, sig, args, G):
    """Two tiles where out has 8 rows, else one; the min term only where has_min."""
    op, path = _Operands(context, builder, sig, args, G), tile_path(context.codegen()._tm_features)
    two = builder.icmp_unsigned("==", builder.extract_value(context.make_array(sig.args[-1])(
        context, builder, args[-1]).shape, 0), ir.Constant(I64, 2 * ROWS))
    mins = builder.icmp_unsigned("!=", op.has_min, ir.Constant(I64, 0))
    for tiles_case, tiles in ((two, 2), (builder.not_(two), 1)):
        with builder.if_then(tiles_case):
            with builder.if_else(mins) as (yes, no):
                with yes:
                    _products(op, tiles, True, path)
                with no:
                    _products(op, tiles, False, path)
    return context.get_dummy_value()


def _register_unpack(plain, shape):
    @intrinsic
    def unpack(typingctx, row, u, a, c):
        def codegen(context, builder, sig, args):
            return _unpack(context, builder, sig, args, shape)
        ok = (isinstance(row, types.Array) and row.dtype == types.uint8 and _contiguous(u, a, c)
              and u.dtype == types.uint8 and a.dtype == c.dtype == types.float32)
        return (types.none(row, u, a, c), codegen) if ok else None

    @overload(plain, inline="always")
    def _plain(row, u, a, c):
        """A row whose blocks are a stride apart (a slot view) is read in place if each block's
        bytes are contiguous, else copied."""
        if _contiguous(row):
            return lambda row, u, a, c: unpack(row, u, a, c)

        def strided(row, u, a, c):
            if row.strides[1] == 1:
                unpack(row, u, a, c)
            else:
                unpack(np.ascontiguousarray(row), u, a, c)
        return strided


def _register_igemm(plain, G):
    @intrinsic
    def igemm(typingctx, u, a, c, xt, xd, xs, xb, r0, t0, has_min, out):
        def codegen(context, builder, sig, args):
            return _igemm(context, builder, sig, args, G)
        dtypes = (types.uint8, types.float32, types.float32, types.int8, types.float32, types.float32, types.int32,
                  types.float32)
        arrays = (u, a, c, xt, xd, xs, xb, out)
        ok = _contiguous(*arrays) and all(x.dtype == d for x, d in zip(arrays, dtypes))
        ok = ok and r0 == t0 == has_min == types.int64
        return (types.none(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out), codegen) if ok else None

    @overload(plain, inline="always")
    def _plain(u, a, c, xt, xd, xs, xb, r0, t0, has_min, out):
        return lambda u, a, c, xt, xd, xs, xb, r0, t0, has_min, out: igemm(
            u, a, c, xt, xd, xs, xb, np.int64(r0), np.int64(t0), np.int64(has_min), out)


for _name, _shape in FORMATS.items():
    _register_unpack(getattr(_simd, f"unpack_{_name}"), _shape)
for _G in (16, 32):
    _register_igemm(getattr(_simd, f"igemm_g{_G}"), _G)
