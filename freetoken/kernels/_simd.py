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


def _f16(raw):
    return np.float32(np.frombuffer(raw.tobytes(), np.float16)[0])


def _scale_min_k4(sc):
    """The 8 (scale, min) 6-bit pairs packed in a q4_k block's 12 scale bytes."""
    sc = sc.astype(np.int32)
    scale = np.concatenate([sc[0:4] & 63, (sc[8:12] & 15) | ((sc[0:4] >> 6) << 4)])
    mins = np.concatenate([sc[4:8] & 63, (sc[8:12] >> 4) | ((sc[4:8] >> 6) << 4)])
    return scale.astype(np.float32), mins.astype(np.float32)


def dot_q4_k(row, xv):
    """sum over blocks b and sub-blocks j of (d*scale_j * q - dmin*min_j) . x for a q4_k row: d, dmin
    fp16 at bytes 0, 2; 6-bit scales and mins at 4; quants at 16, sub-blocks 2p and 2p + 1 in the
    low and high nibbles of bytes 16 + 32p .. + 31."""
    total = np.float32(0.0)
    for b in range(row.shape[0]):
        scale, mins = _scale_min_k4(row[b, 4:16])
        qs = row[b, 16:144].reshape(4, 32)
        q = np.stack([qs & 15, qs >> 4], 1).reshape(8, 32).astype(np.float32)
        a, c = _f16(row[b, 0:2]) * scale, _f16(row[b, 2:4]) * mins
        total += ((a[:, None] * q - c[:, None]) * xv[b].reshape(8, 32)).sum(dtype=np.float32)
    return np.float32(total)


def dot_q6_k(row, xv):
    """sum over blocks of (d * scale_i * (q - 32)) . x for a q6_k row: low 4 bits at byte 0 (ql),
    high 2 at 128 (qh), 16 int8 scales at 192, d fp16 at 208, unpacked as gguf-py does."""
    total = np.float32(0.0)
    for b in range(row.shape[0]):
        ql, qh = row[b, :128].astype(np.int32), row[b, 128:192].astype(np.int32)
        q = np.empty(256, np.int32)
        for n in range(2):
            lo, hi, h = ql[64 * n:64 * n + 32], ql[64 * n + 32:64 * n + 64], qh[32 * n:32 * n + 32]
            q[128 * n:128 * n + 128] = np.concatenate([
                (lo & 15) | ((h & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4),
                (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4)])
        a = _f16(row[b, 208:210]) * row[b, 192:208].view(np.int8).astype(np.float32)
        total += (np.repeat(a, 16) * (q - 32).astype(np.float32) * xv[b]).sum(dtype=np.float32)
    return np.float32(total)


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

    def load(builder, ptr, at, ty, align):
        return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(i64, at)]), ty.as_pointer()), align=align)

    def bytes_at(builder, ptr, at):
        return load(builder, ptr, at, ir.VectorType(ir.IntType(8), LANES), 1)

    def i8s(value):
        return ir.Constant(ir.VectorType(ir.IntType(8), LANES), [value] * LANES)

    def scalar_at(builder, arr, i):
        return builder.load(builder.gep(arr.data, [ir.Constant(i64, i)]))

    def two_halves(builder, lo, hi):
        """[lo x16, hi x16]: the scales of two 16-value sub-blocks side by side."""
        pair = builder.insert_element(ir.Constant(ir.VectorType(f32, 2), None), lo, ir.Constant(ir.IntType(32), 0))
        pair = builder.insert_element(pair, hi, ir.Constant(ir.IntType(32), 1))
        return builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                                              [0] * 16 + [1] * 16))

    def contiguous(*arrays_):
        return all(isinstance(t, types.Array) and t.layout == "C" for t in arrays_)

    def lanes(builder, vector, picks):
        """A shuffle of `vector`'s lanes (any width) into len(picks) lanes."""
        mask = ir.Constant(ir.VectorType(ir.IntType(32), len(picks)), list(picks))
        return builder.shuffle_vector(vector, vector, mask)

    def small(bits, n, value):
        return ir.Constant(ir.VectorType(ir.IntType(bits), n), [value] * n)

    def k4_coefficients(builder, block):
        """(d * scale_j, dmin * min_j) for the 8 sub-blocks j of a q4_k block, as <8 x float>:
        j < 4: low 6 bits of bytes 4 + j, 8 + j; else 4 bits of byte 8 + j and the top 2 of
        bytes j, 4 + j."""
        raw = load(builder, block, 4, ir.VectorType(ir.IntType(8), 16), 1)    # scale bytes s0..s11
        first = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 4 + [0] * 4)
        out = []
        for low, top, scale in (((0, 1, 2, 3, 8, 9, 10, 11), (0, 1, 2, 3) * 2, "d"),
                                ((4, 5, 6, 7, 8, 9, 10, 11), (4, 5, 6, 7) * 2, "m")):
            p, q = lanes(builder, raw, low), lanes(builder, raw, top)
            high = builder.shl(builder.lshr(q, small(8, 8, 6)), small(8, 8, 4))
            nib = builder.and_(p, small(8, 8, 15)) if scale == "d" else builder.lshr(p, small(8, 8, 4))
            six = builder.select(first, builder.and_(p, small(8, 8, 63)), builder.or_(nib, high))
            factor = builder.fpext(load(builder, block, 0 if scale == "d" else 2, ir.HalfType(), 1), f32)
            out.append(builder.fmul(builder.uitofp(six, ir.VectorType(f32, 8)), lanes8(builder, factor)))
        return out

    def lanes8(builder, value):
        one = builder.insert_element(ir.Constant(ir.VectorType(f32, 8), None), value, ir.Constant(ir.IntType(32), 0))
        return lanes(builder, one, [0] * 8)

    def row_loop(context, builder, sig, args, block_bytes, body):
        """Sum over the blocks of a row of body(builder, block pointer, x pointer) -> <32 x float>."""
        rows, xs = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
        acc = cgutils.alloca_once_value(builder, ir.Constant(vec, None))
        with cgutils.for_range(builder, builder.extract_value(rows.shape, 0)) as loop:
            block = builder.gep(rows.data, [builder.mul(loop.index, ir.Constant(i64, block_bytes))])
            xb = builder.gep(xs.data, [builder.mul(loop.index, ir.Constant(i64, 256))])
            builder.store(builder.fadd(builder.load(acc), body(builder, block, xb)), acc)
        total = fn(builder, "llvm.vector.reduce.fadd.v32f32", f32, [f32, vec])
        return builder.call(total, [ir.Constant(f32, 0.0), builder.load(acc)], fastmath=("reassoc",))

    def q4_k_block(builder, block, xb):
        fma = fn(builder, "llvm.fma.v32f32", vec, [vec, vec, vec])
        a8, c8 = k4_coefficients(builder, block)
        acc, mins = ir.Constant(vec, None), ir.Constant(vec, None)
        for p in range(4):
            quants = bytes_at(builder, block, 16 + 32 * p)
            for half, q in enumerate((builder.and_(quants, i8s(15)), builder.lshr(quants, i8s(4)))):
                j = 2 * p + half
                x = load(builder, xb, 32 * j, vec, 4)
                acc = builder.call(fma, [builder.fmul(builder.uitofp(q, vec), x), lanes(builder, a8, [j] * LANES), acc])
                mins = builder.call(fma, [x, lanes(builder, c8, [j] * LANES), mins])
        return builder.fsub(acc, mins)

    def q6_k_block(builder, block, xb):
        fma = fn(builder, "llvm.fma.v32f32", vec, [vec, vec, vec])
        d = builder.fpext(load(builder, block, 208, ir.HalfType(), 1), f32)
        scales = builder.sitofp(load(builder, block, 192, ir.VectorType(ir.IntType(8), 16), 1), ir.VectorType(f32, 16))
        d16 = lanes(builder, builder.insert_element(ir.Constant(ir.VectorType(f32, 16), None), d,
                                                    ir.Constant(ir.IntType(32), 0)), [0] * 16)
        a16 = builder.fmul(scales, d16)
        acc = ir.Constant(vec, None)
        for n in range(2):
            lo, hi, h = (bytes_at(builder, block, 64 * n), bytes_at(builder, block, 64 * n + 32),
                         bytes_at(builder, block, 128 + 32 * n))
            parts = ((lo, 0), (hi, 2), (builder.lshr(lo, i8s(4)), 4), (builder.lshr(hi, i8s(4)), 6))
            for k, (low, shift) in enumerate(parts):
                top = builder.shl(builder.and_(builder.lshr(h, i8s(shift)), i8s(3)), i8s(4))
                q = builder.sub(builder.or_(builder.and_(low, i8s(15)), top), i8s(32))
                s0 = 8 * n + 2 * k                       # lanes 0-15: sub-block s0, 16-31: s0 + 1
                x = load(builder, xb, 128 * n + 32 * k, vec, 4)
                acc = builder.call(fma, [builder.fmul(builder.sitofp(q, vec), x),
                                         lanes(builder, a16, [s0] * 16 + [s0 + 1] * 16), acc])
        return acc

    def row_intrinsic(block_bytes, body):
        @intrinsic
        def vector_row(typingctx, row, xv):
            def codegen(context, builder, sig, args):
                return row_loop(context, builder, sig, args, block_bytes, body)
            ok = contiguous(row, xv) and row.dtype == types.uint8 and xv.dtype == types.float32
            return (types.float32(row, xv), codegen) if ok else None
        return vector_row

    def row_overload(vector_row):
        def impl(row, xv):
            if contiguous(row, xv):
                return lambda row, xv: vector_row(row, xv)
            return lambda row, xv: vector_row(np.ascontiguousarray(row), np.ascontiguousarray(xv))
        return impl

    for plain, block_bytes, body in ((dot_q4_k, 144, q4_k_block), (dot_q6_k, 210, q6_k_block)):
        overload(plain, inline="always")(row_overload(row_intrinsic(block_bytes, body)))

    @overload(dot_q8_0, inline="always")
    def _dot_q8_0(row, xv):
        if row.layout == "C" and xv.layout == "C":
            return lambda row, xv: q8_0_vector(row, xv)
        # a strided view (no caller passes one today): a contiguous copy, then the same code
        return lambda row, xv: q8_0_vector(np.ascontiguousarray(row), np.ascontiguousarray(xv))
