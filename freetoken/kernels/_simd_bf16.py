"""The LLVM IR of kernels/_simd.py's bf16 tile product (``btile_bf16``) and its numba overload: four
bf16 weight rows against two tiles of 16 tokens with AVX512-BF16's ``vdpbf16ps``. Imported only by
_simd.register, once numba is loaded; compiled into a kernel only on a CPU that has the
instruction (kernels/_isa.py ``bf16_dots``: the callers check it first).

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
"""
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
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
