"""The LLVM IR of kernels/_simd.py's int8 tile products (``itile_*``) and their numba overloads: one
quantized weight row against tiles of 16 tokens. Imported only by _simd.register, once numba is
loaded.

Lanes are tokens, not positions: a tile holds 16 tokens' rounded activations (kernels/qact.py)
interleaved 4 values at a time, so xt[n, v/4] is 64 bytes, token l's values v .. v+3 at bytes
4l .. 4l+3. One vpdpbusd then multiplies 4 of the row's (unsigned) quants, the same 4 in every
lane, by those 4 values of 16 tokens and adds 16 int32 sums: a group's sums come out one per
token with no horizontal reduction, and each weight block is unpacked once for all the tiles
(the GEMV dots, kernels/_simd_int8.py, unpack it once per token). This is what makes prefill of a
quantized file an integer GEMM rather than dequantize-then-fp32-BLAS.

Per group of G values (32; 16 for q2_k, q3_k and q6_k) a format's values are a*u - c: u the
unsigned quant (q8_0 stores it signed: u = q + 128; mxfp4's doubled e2m1 values -12..12 + 12), a
and c fp32 per group. The integer sum starts from the tile's xb = -off * sum(xq) (off: 128 for
q8_0, 32 for q6_k, 12 for mxfp4, 8 for q4_0, 16 for q5_0, 4 for q3_k) so sum(u*xq) + xb is the
exact sum((u - off) * xq); then acc += a * xd * sum, and the mins (q4_k, q5_k, q2_k; q4_1 and
q5_1 add theirs: c = -min) acc -= c * xs with xs = xd * sum(xq). Same spec and tolerance as the
GEMV dots: the dequantized row against the rounded x (q * xd), fp32 math in another order.

Shapes: row u8[NB,S]; xt i8[N,K/4,16,4]; xd f32[N,K/32,16]; xs f32[N,K/G,16]; xb
i32[N,K/G,16]; out f32[NT,16] from tiles first .. first + NT; all C-contiguous, K = NB*V.
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
from freetoken.kernels._isa import int8_tile_path
from freetoken.kernels._simd_int8 import _kvalues, _q6_k_slices, idot, mxfp4_codes, mxfp4_half_scale
from freetoken.kernels._simd_int8_low import legacy_quants, q2_k_coefficients, q3_k_quants, q3_k_scales, two_bits
from freetoken.kernels._simd_ir import (F32, I8, I32, I64, _bytes, _contiguous, _fp16, _function,
                                        _k4_coefficients, _lanes, _same, _splat)

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


def _broadcast4(builder, u, i):
    """Bytes 4i .. 4i+3 of u <G x i8> repeated in all 16 lanes, <64 x i8>."""
    words = builder.bitcast(u, ir.VectorType(I32, u.type.count // 4))
    return builder.bitcast(_lanes(builder, words, [i] * LANES), I8x64)


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


class _Tile:
    """Pointers and sizes of one call's arrays, and the address of each operand."""

    def __init__(self, context, builder, sig, args, shape):
        self.b, (self.S, self.V, self.G, self.off, _) = builder, shape
        arrays = [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else a
                  for t, a in zip(sig.args, args)]
        row, xt, xd, xs, xb, self.first, out = arrays
        self.row, self.xt, self.xd, self.xs, self.xb, self.out = row.data, xt.data, xd.data, xs.data, xb.data, out.data
        self.nb, self.nt = builder.extract_value(row.shape, 0), builder.extract_value(out.shape, 0)
        self.block_stride = builder.extract_value(row.strides, 0)     # S, or a slot view's
        self.k = builder.mul(self.nb, ir.Constant(I64, self.V))

    def _at(self, ptr, nt, v, per, width):
        """Element offset (nt * K/per + v/per) * width of ptr (v: an i64 value index)."""
        b, per_c = self.b, ir.Constant(I64, per)
        index = b.add(b.mul(b.add(nt, self.first), b.udiv(self.k, per_c)), b.udiv(v, per_c))
        return b.gep(ptr, [b.mul(index, ir.Constant(I64, width))])

    def vec(self, name, nt, v, ty):
        per = {"xt": 4, "xd": 32, "xs": self.G, "xb": self.G}[name]
        at = self._at(getattr(self, name), nt, v, per, 64 if name == "xt" else LANES)
        return self.b.load(self.b.bitcast(at, ty.as_pointer()), align=4)


def _group_into(t, acc, nt, v0, group, path):
    """acc <16 x float> + one group of one row against tile nt's tokens (value index v0)."""
    b, (u, a, c) = t.b, group
    isum = t.vec("xb", nt, v0, I32x16) if t.off else ir.Constant(I32x16, None)
    for i in range(t.G // 4):
        x = t.vec("xt", nt, b.add(v0, ir.Constant(I64, 4 * i)), I8x64)
        isum = _vnni16(b, isum, _broadcast4(b, u, i), x, path)
    scale = b.fmul(_splat(b, a, LANES), t.vec("xd", nt, v0, F32x16))
    fma = _function(b, "llvm.fma.v16f32", F32x16, [F32x16] * 3)
    acc = b.call(fma, [b.sitofp(isum, F32x16), scale, acc])
    if c is not None:
        acc = b.fsub(acc, b.fmul(_splat(b, c, LANES), t.vec("xs", nt, v0, F32x16)))
    return acc


def _itile(context, builder, sig, args, shape):
    """out[n] = the row against tile n, for every tile: blocks outer (each unpacked once), tiles
    inner, the 16 sums of a tile carried in out."""
    t, path = _Tile(context, builder, sig, args, shape), tile_path(context.codegen()._tm_features)
    out_vec = lambda nt: builder.bitcast(builder.gep(t.out, [builder.mul(nt, ir.Constant(I64, LANES))]), F32x16.as_pointer())
    with cgutils.for_range(builder, t.nt) as tiles:
        builder.store(ir.Constant(F32x16, None), out_vec(tiles.index), align=4)
    with cgutils.for_range(builder, t.nb) as blocks:
        block = builder.gep(t.row, [builder.mul(blocks.index, t.block_stride)])
        groups, base = shape[4](builder, block, path), builder.mul(blocks.index, ir.Constant(I64, t.V))
        with cgutils.for_range(builder, t.nt) as tiles:
            acc = builder.load(out_vec(tiles.index), align=4)
            for gi, group in enumerate(groups):
                acc = _group_into(t, acc, tiles.index, builder.add(base, ir.Constant(I64, gi * t.G)), group, path)
            builder.store(acc, out_vec(tiles.index), align=4)
    return context.get_dummy_value()


def _register_itile(plain, shape):
    @intrinsic
    def itile(typingctx, row, xt, xd, xs, xb, first, out):
        def codegen(context, builder, sig, args):
            return _itile(context, builder, sig, args, shape)
        dtypes = (types.uint8, types.int8, types.float32, types.float32, types.int32, types.float32)
        arrays = (row, xt, xd, xs, xb, out)
        ok = _contiguous(*arrays[1:]) and all(a.dtype == d for a, d in zip(arrays, dtypes))
        ok = ok and first == types.int64
        return (types.none(row, xt, xd, xs, xb, first, out), codegen) if ok else None

    @overload(plain, inline="always")
    def _plain(row, xt, xd, xs, xb, first, out):
        """A row whose blocks are a stride apart (a slot view) is read in place if each block's
        bytes are contiguous, else copied."""
        if not _contiguous(xt, xd, xs, xb, out):
            return None
        if _contiguous(row):
            return lambda row, xt, xd, xs, xb, first, out: itile(row, xt, xd, xs, xb, np.int64(first), out)

        def strided(row, xt, xd, xs, xb, first, out):
            if row.strides[1] == 1:
                itile(row, xt, xd, xs, xb, np.int64(first), out)
            else:
                itile(np.ascontiguousarray(row), xt, xd, xs, xb, np.int64(first), out)
        return strided


for _name, _shape in FORMATS.items():
    _register_itile(getattr(_simd, f"itile_{_name}"), _shape)
