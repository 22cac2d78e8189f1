"""The LLVM IR of kernels/_simd.py's bf16 products on AVX512-BF16's ``vdpbf16ps`` and their numba
overloads: the tile product (``btile_bf16``: four bf16 weight rows against two tiles of 16 tokens)
and the decode row dots (``bdot_rows2``/``bdot_rows4``, below). Imported only by _simd.register,
once numba is loaded. The tile product compiles only on a CPU that has the instruction
(kernels/_isa.py ``bf16_dots``: its callers check it first); the row dots check it themselves.

vdpbf16ps acc, w, x adds, per fp32 lane i, w[2i]*x[2i] + w[2i+1]*x[2i+1]: bf16 inputs, products
exact in fp32, denormal inputs and results flushed to zero. A tile holds 16 tokens' bf16
activations two values at a time: xt[n, j] is 16 uint32 words, word l holding token l's values
2j and 2j+1. A row's word j (its values 2j, 2j+1) repeated in all 16 lanes then adds 16 tokens'
pair sums in one instruction, with no horizontal sum. Four rows and two tiles keep 8 accumulators
in registers: each step loads 2 tile words and 4 row words for 8 instructions (one tile and one
row a step ran load-bound in the int8 tiles, kernels/_simd_itile.py).

llvmlite has no bfloat type, which LLVM's own intrinsic (llvm.x86.avx512bf16.dpbf16ps.512) takes,
so the instruction is inline assembly on <16 x i32> operands; numba's code generator is given
LLVM's asm parser for it (``enable_inline_asm``).

Shapes: w u32[R,K/2] (a bf16 row [K] read as pairs: kernels/_numba.weight_rows); xt
u32[NT,K/2,16]; out f32[R,NT,16]; rows r0 .. r0+3 and tiles t0, t0+1 written.

The decode row dots (``bdot_rows2``/``bdot_rows4``: one token's bf16 pairs xw u32[K/2] against 2 or 4
rows) run the same instruction lane-wise, 16 words a step, a row's lanes summed once at the end: a
quarter of the instructions of widening both halves to fp32 (shift, mask, two FMAs a word), which
let the rows stream at the box's read rate (bf16 decode, Zen 4). Words past the last full step,
and every word on a target without the instruction, are widened to fp32 (``_widened2``/``_widened4``).
"""
import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
from freetoken.kernels._numba import from_bits
from freetoken.kernels._isa import bf16_dots
from freetoken.kernels._simd_ir import F32, I32, I64, _contiguous

ROWS, TILES, LANES = 4, 2, 16
F32x16, I32x16 = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES)


def enable_inline_asm() -> None:
    """LLVM parses inline assembly only with the target's asm parser initialized (numba does not)."""
    binding.initialize_native_asmparser()


def _dpbf16ps(builder, acc, w, x):
    kind = ir.FunctionType(F32x16, [F32x16, I32x16, I32x16])
    return builder.asm(kind, "vdpbf16ps $3, $2, $0", "=v,0,v,v", [acc, w, x], side_effect=False)


def _at(builder, base, index, width, ty):
    """Pointer to the `ty` at element index * width of base."""
    return builder.bitcast(builder.gep(base, [builder.mul(index, ir.Constant(I64, width))]), ty.as_pointer())


def _btile(context, builder, sig, args):
    w, xt, out = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 4))
    r0, t0 = args[2], args[3]
    kp, nt = builder.extract_value(w.shape, 1), builder.extract_value(out.shape, 1)
    rows = [builder.add(r0, ir.Constant(I64, j)) for j in range(ROWS)]
    tiles = [builder.add(t0, ir.Constant(I64, t)) for t in range(TILES)]
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(F32x16, None)) for _ in tiles] for _ in rows]
    zero = ir.Constant(I32x16, None)
    with cgutils.for_range(builder, kp) as loop:
        k = loop.index
        xs = [builder.load(_at(builder, xt.data, builder.add(builder.mul(t, kp), k), LANES, I32x16), align=4)
              for t in tiles]
        for j, r in enumerate(rows):
            word = builder.load(builder.gep(w.data, [builder.add(builder.mul(r, kp), k)]), align=4)
            same = builder.shuffle_vector(builder.insert_element(zero, word, ir.Constant(I32, 0)), zero,
                                          ir.Constant(I32x16, [0] * LANES))
            for t, x in enumerate(xs):
                builder.store(_dpbf16ps(builder, builder.load(accs[j][t]), same, x), accs[j][t])
    for j, r in enumerate(rows):
        for t, tile in enumerate(tiles):
            at = builder.add(builder.mul(r, nt), tile)
            builder.store(builder.load(accs[j][t]), _at(builder, out.data, at, LANES, F32x16), align=4)
    return context.get_dummy_value()


@intrinsic
def _btile_bf16(typingctx, w, xt, r0, t0, out):
    ok = (_contiguous(w, xt, out) and w.dtype == types.uint32 and xt.dtype == types.uint32
          and out.dtype == types.float32 and r0 == types.int64 and t0 == types.int64)
    return (types.none(w, xt, r0, t0, out), _btile) if ok else None


@overload(_simd.btile_bf16, inline="always")
def _plain(w, xt, r0, t0, out):
    return lambda w, xt, r0, t0, out: _btile_bf16(w, xt, r0, t0, out)


def _lanes_summed(builder, v):
    """The sum of a <16 x float>'s lanes: four halvings, each two shuffles and an add."""
    n = LANES
    while n > 1:
        n //= 2
        low, high = (ir.Constant(ir.VectorType(I32, n), list(range(at, at + n))) for at in (0, n))
        v = builder.fadd(builder.shuffle_vector(v, v, low), builder.shuffle_vector(v, v, high))
    return builder.extract_element(v, ir.Constant(I32, 0))


def _row_dots(n_rows, steps):
    """Codegen of n_rows rows (args 2 ..) of w against xw over the first K/2 // (16 * steps) *
    (16 * steps) words; `steps` accumulators a row, so each row's adds form that many chains."""
    def codegen(context, builder, sig, args):
        w, xw = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1))
        kp = builder.extract_value(w.shape, 1)
        starts = [builder.mul(r, kp) for r in args[2:]]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(F32x16, None)) for _ in range(steps)] for _ in starts]
        with cgutils.for_range(builder, builder.udiv(kp, ir.Constant(I64, LANES * steps))) as loop:
            for step in range(steps):
                k = builder.add(builder.mul(loop.index, ir.Constant(I64, steps)), ir.Constant(I64, step))
                x = builder.load(_at(builder, xw.data, k, LANES, I32x16), align=4)
                for start, acc in zip(starts, accs):
                    word = builder.gep(w.data, [builder.add(start, builder.mul(k, ir.Constant(I64, LANES)))])
                    row = builder.load(builder.bitcast(word, I32x16.as_pointer()), align=4)
                    builder.store(_dpbf16ps(builder, builder.load(acc[step]), row, x), acc[step])
        sums = []
        for acc in accs:
            v = builder.load(acc[0])
            for more in acc[1:]:
                v = builder.fadd(v, builder.load(more))
            sums.append(_lanes_summed(builder, v))
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


def _row_dots_typed(w, xw, rows, steps):
    ok = (_contiguous(w, xw) and w.ndim == 2 and xw.ndim == 1 and w.dtype == xw.dtype == types.uint32
          and all(r == types.int64 for r in rows))
    return (types.UniTuple(types.float32, len(rows))(w, xw, *rows), _row_dots(len(rows), steps)) if ok else None


_STEPS2, _STEPS4 = 2, 1                          # accumulators a row: 4 add chains a call either way
_STEP2, _STEP4 = _STEPS2 * LANES, _STEPS4 * LANES  # words a loop step


@intrinsic
def _dots2(typingctx, w, xw, r0, r1):
    return _row_dots_typed(w, xw, (r0, r1), _STEPS2)


@intrinsic
def _dots4(typingctx, w, xw, r0, r1, r2, r3):
    return _row_dots_typed(w, xw, (r0, r1, r2, r3), _STEPS4)


@numba.njit(inline="always", fastmath=True)
def _halves(word):
    """A word's two bf16 values widened to fp32: (the even one, the odd one)."""
    return from_bits(word << np.uint32(16)), from_bits(word & np.uint32(0xFFFF0000))


@numba.njit(inline="always", fastmath=True)
def _widened2(w, xw, r0, r1, k0):
    """Words k0 .. K/2 of rows r0, r1 against xw, both widened to fp32 (the products exact)."""
    a0 = b0 = a1 = b1 = np.float32(0.0)
    for k in range(k0, w.shape[1]):
        e, o = _halves(xw[k])
        p0, p1 = _halves(w[r0, k])
        q0, q1 = _halves(w[r1, k])
        a0, b0, a1, b1 = a0 + e * p0, b0 + o * p1, a1 + e * q0, b1 + o * q1
    return a0 + b0, a1 + b1


@numba.njit(inline="always", fastmath=True)
def _widened4(w, xw, r0, r1, r2, r3, k0):
    """_widened2 for four rows."""
    a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = np.float32(0.0)
    for k in range(k0, w.shape[1]):
        e, o = _halves(xw[k])
        p0, p1 = _halves(w[r0, k])
        q0, q1 = _halves(w[r1, k])
        s0, s1 = _halves(w[r2, k])
        t0, t1 = _halves(w[r3, k])
        a0, b0, a1, b1 = a0 + e * p0, b0 + o * p1, a1 + e * q0, b1 + o * q1
        a2, b2, a3, b3 = a2 + e * s0, b2 + o * s1, a3 + e * t0, b3 + o * t1
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@overload(_simd.bf16_dots_here, inline="always")
def _plain_here():
    here = bf16_dots()
    return lambda: here


def _vector_rows(w, xw) -> bool:
    """Whether the row dots compile to vdpbf16ps: the target has it and both arrays are C-contiguous
    (else every word is widened)."""
    return bf16_dots() and _contiguous(w, xw)


@overload(_simd.bdot_rows2, inline="always")
def _plain_rows2(w, xw, r0, r1):
    if not _vector_rows(w, xw):
        return lambda w, xw, r0, r1: _widened2(w, xw, r0, r1, 0)

    def rows2(w, xw, r0, r1):
        a, b = _dots2(w, xw, np.int64(r0), np.int64(r1))
        ta, tb = _widened2(w, xw, r0, r1, w.shape[1] // _STEP2 * _STEP2)
        return a + ta, b + tb
    return rows2


@overload(_simd.bdot_rows4, inline="always")
def _plain_rows4(w, xw, r0, r1, r2, r3):
    if not _vector_rows(w, xw):
        return lambda w, xw, r0, r1, r2, r3: _widened4(w, xw, r0, r1, r2, r3, 0)

    def rows4(w, xw, r0, r1, r2, r3):
        a, b, c, d = _dots4(w, xw, np.int64(r0), np.int64(r1), np.int64(r2), np.int64(r3))
        ta, tb, tc, td = _widened4(w, xw, r0, r1, r2, r3, w.shape[1] // _STEP4 * _STEP4)
        return a + ta, b + tb, c + tc, d + td
    return rows4
