"""Row dots written as explicit LLVM vector code, for the block formats whose per-block structure
numba's auto-vectoriser leaves scalar (it runs no SLP pass, and LLVM unrolls a loop over one
block before the loop vectoriser sees it). The vectors are generic LLVM types (<32 x float>),
lowered by LLVM to whatever the host has: two AVX-512 registers, or four AVX2 ones.

Same spec and tolerance as the numba dots in qblocks.py: the blocks' values exactly, fp32 math in
another order (a block's scale applied once to its 32 products; the row's sum reassociated).

Each dot here is a plain function (the Python fallback, for uncompiled use) that numba
compiles through an overload registered by ``register`` from kernels/_numba.py.

Shapes: row u8[NB,S] (NB blocks of S bytes), xv f32[NB,V] (V values per block).
"""
import numpy as np

LANES = 32              # values per vector: one q8_0 block


def dot_q8_0(row, xv):
    """sum_b d_b * sum_l q[b,l] * xv[b,l] for a q8_0 row (d fp16 at byte 0, 32 int8 quants)."""
    d = np.ascontiguousarray(row[:, :2]).view(np.float16)[:, 0].astype(np.float32)
    q = np.ascontiguousarray(row[:, 2:34]).view(np.int8).astype(np.float32)
    return np.float32((d * (q * xv).sum(1, dtype=np.float32)).sum(dtype=np.float32))


def register(numba):
    """Compile-time overloads of the dots above (called once, when numba is loaded)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, LANES)

    def fn(builder, name, ret, params):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)

    def splat(builder, value):
        one = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(vec, None),
                                      ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))

    @intrinsic
    def q8_0_vector(typingctx, row, xv):
        def codegen(context, builder, sig, args):
            rows = context.make_array(sig.args[0])(context, builder, args[0])
            xs = context.make_array(sig.args[1])(context, builder, args[1])
            fma = fn(builder, "llvm.fma.v32f32", vec, [vec, vec, vec])
            acc = cgutils.alloca_once_value(builder, ir.Constant(vec, None))
            with cgutils.for_range(builder, builder.extract_value(rows.shape, 0)) as loop:
                block = builder.gep(rows.data, [builder.mul(loop.index, ir.Constant(i64, 34))])
                d = builder.fpext(builder.load(builder.bitcast(block, ir.HalfType().as_pointer()), align=1), f32)
                quants = builder.bitcast(builder.gep(block, [ir.Constant(i64, 2)]),
                                         ir.VectorType(ir.IntType(8), LANES).as_pointer())
                q = builder.sitofp(builder.load(quants, align=1), vec)
                x_at = builder.gep(xs.data, [builder.mul(loop.index, ir.Constant(i64, LANES))])
                x = builder.load(builder.bitcast(x_at, vec.as_pointer()), align=4)
                builder.store(builder.call(fma, [builder.fmul(q, x), splat(builder, d), builder.load(acc)]), acc)
            total = fn(builder, "llvm.vector.reduce.fadd.v32f32", f32, [f32, vec])
            return builder.call(total, [ir.Constant(f32, 0.0), builder.load(acc)], fastmath=("reassoc",))
        ok = (isinstance(row, types.Array) and row.dtype == types.uint8 and row.ndim == 2 and row.layout == "C"
              and isinstance(xv, types.Array) and xv.dtype == types.float32 and xv.ndim == 2 and xv.layout == "C")
        return (types.float32(row, xv), codegen) if ok else None

    @overload(dot_q8_0, inline="always")
    def _dot_q8_0(row, xv):
        if row.layout == "C" and xv.layout == "C":
            return lambda row, xv: q8_0_vector(row, xv)
        # a strided view (no caller passes one today): a contiguous copy, then the same code
        return lambda row, xv: q8_0_vector(np.ascontiguousarray(row), np.ascontiguousarray(xv))
