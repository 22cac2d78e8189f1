"""The LLVM IR of kernels/_simd.py's vector row dots, and their numba overloads. Imported only
by _simd.register, once numba is loaded (it imports numba and llvmlite at the top).

Each row dot is one loop over the row's blocks that adds one <32 x float> per block (the block's
values times x, its scales applied per 32 or 16 lanes) and reduces once at the end.

Shapes: row u8[NB,S] C-contiguous; xv f32[NB,V] C-contiguous; V = 32 (q8_0) or 256 (K-quants).
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _isa, _simd

LANES = _simd.LANES
F32, I32, I64, I8 = ir.FloatType(), ir.IntType(32), ir.IntType(64), ir.IntType(8)
VEC = ir.VectorType(F32, LANES)           # one q8_0 block, or a 32-value q4_k/q6_k slice


def _function(builder, name, ret, params):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)


def _fma(builder, a, b, c):
    return builder.call(_function(builder, "llvm.fma.v32f32", VEC, [VEC, VEC, VEC]), [a, b, c])


def _load(builder, ptr, at, ty, align):
    """A `ty` at byte (or element) offset `at` of `ptr`."""
    return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(I64, at)]), ty.as_pointer()), align=align)


def _bytes(builder, ptr, at, n=LANES):
    return _load(builder, ptr, at, ir.VectorType(I8, n), 1)


def _fp16(builder, block, at):
    """The fp16 at byte `at` of block, as fp32: one fpext (vcvtph2ps) where the target has F16C;
    elsewhere (NUMBA_CPU_NAME=generic) LLVM lowers fpext to __extendhfsf2, a symbol numba's JIT
    does not link (the process aborts), so the bits are widened by hand."""
    from freetoken.kernels._isa import host
    if "f16c" in host()[1]:
        return builder.fpext(_load(builder, block, at, ir.HalfType(), 1), F32)
    return _fp16_bits(builder, builder.zext(_load(builder, block, at, ir.IntType(16), 1), I32))


def _fp16_bits(builder, h):
    """fp32 of the fp16 bits h (i32): exponent rebiased by 112; all-ones stays inf/NaN; zero and
    subnormals are the mantissa times 2**-24 (exact)."""
    c = lambda v: ir.Constant(I32, v)                                          # noqa: E731
    exponent, mantissa = builder.and_(builder.lshr(h, c(10)), c(31)), builder.and_(h, c(1023))
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    normal = builder.or_(builder.shl(builder.add(exponent, c(112)), c(23)), builder.shl(mantissa, c(13)))
    special = builder.or_(c(0x7F800000), builder.shl(mantissa, c(13)))
    bits = builder.select(builder.icmp_unsigned("==", exponent, c(31)), special, normal)
    tiny = builder.bitcast(builder.fmul(builder.sitofp(mantissa, F32), ir.Constant(F32, 2.0 ** -24)), I32)
    bits = builder.select(builder.icmp_unsigned("==", exponent, c(0)), tiny, bits)
    return builder.bitcast(builder.or_(bits, sign), F32)


def _same(bits, n, value):
    return ir.Constant(ir.VectorType(ir.IntType(bits), n), [value] * n)


def _lanes(builder, vector, picks):
    """Lanes `picks` of `vector` (any width) as a vector of len(picks) lanes."""
    return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(I32, len(picks)), list(picks)))


def _splat(builder, value, n=LANES):
    """value (a float or an integer) in all n lanes."""
    one = builder.insert_element(ir.Constant(ir.VectorType(value.type, n), None), value, ir.Constant(I32, 0))
    return _lanes(builder, one, [0] * n)


def _q8_0(builder, block, xb, acc):
    """acc + d * (q . x) lanes of one q8_0 block: d fp16 at byte 0, 32 int8 quants at 2."""
    q = builder.sitofp(_bytes(builder, block, 2), VEC)
    return _fma(builder, builder.fmul(q, _load(builder, xb, 0, VEC, 4)), _splat(builder, _fp16(builder, block, 0)), acc)


def _k4_coefficients(builder, block):
    """(d * scale_j, dmin * min_j) of a q4_k block's 8 sub-blocks, each <8 x float>: j < 4: low 6
    bits of scale bytes j, j + 4; else 4 bits of byte j + 4 and the top 2 of bytes j - 4, j."""
    raw = _bytes(builder, block, 4, 16)                             # scale bytes s0..s11 (+4 of qs)
    first_four = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 4 + [0] * 4)
    out = []
    for low, top, at in (((0, 1, 2, 3, 8, 9, 10, 11), (0, 1, 2, 3) * 2, 0),
                         ((4, 5, 6, 7, 8, 9, 10, 11), (4, 5, 6, 7) * 2, 2)):
        p, q = _lanes(builder, raw, low), _lanes(builder, raw, top)
        high = builder.shl(builder.lshr(q, _same(8, 8, 6)), _same(8, 8, 4))
        nibble = builder.and_(p, _same(8, 8, 15)) if at == 0 else builder.lshr(p, _same(8, 8, 4))
        six = builder.select(first_four, builder.and_(p, _same(8, 8, 63)), builder.or_(nibble, high))
        out.append(builder.fmul(builder.uitofp(six, ir.VectorType(F32, 8)), _splat(builder, _fp16(builder, block, at), 8)))
    return out


def _k45(builder, block, xb, acc, qh_at, qs_at):
    """acc + (a_j u - c_j) . x lanes of one q4_k / q5_k block. Sub-blocks 2p, 2p + 1 are the low
    and high nibbles of quant bytes qs_at + 32p .. + 31; q5_k adds bit j of its qh bytes (at
    qh_at, one per lane) as the quant's fifth bit (16)."""
    a8, c8 = _k4_coefficients(builder, block)
    high_bits = _bytes(builder, block, qh_at) if qh_at is not None else None
    mins = ir.Constant(VEC, None)
    for p in range(4):
        quants = _bytes(builder, block, qs_at + 32 * p)
        for half, q in enumerate((builder.and_(quants, _same(8, LANES, 15)), builder.lshr(quants, _same(8, LANES, 4)))):
            j = 2 * p + half
            if high_bits is not None:
                bit = builder.and_(builder.lshr(high_bits, _same(8, LANES, j)), _same(8, LANES, 1))
                q = builder.or_(q, builder.shl(bit, _same(8, LANES, 4)))
            x = _load(builder, xb, 32 * j, VEC, 4)
            acc = _fma(builder, builder.fmul(builder.uitofp(q, VEC), x), _lanes(builder, a8, [j] * LANES), acc)
            mins = _fma(builder, x, _lanes(builder, c8, [j] * LANES), mins)
    return builder.fsub(acc, mins)


def _q4_k(builder, block, xb, acc):
    return _k45(builder, block, xb, acc, None, 16)


def _q5_k(builder, block, xb, acc):
    return _k45(builder, block, xb, acc, 16, 48)


def _q6_k(builder, block, xb, acc):
    """acc + d * scale_i * (q - 32) . x lanes of one q6_k block (gguf-py's unpacking: 4 slices of 32
    per half, low bits from ql, high from qh; lanes 0-15 and 16-31 of a slice: two sub-blocks)."""
    scales = builder.sitofp(_bytes(builder, block, 192, 16), ir.VectorType(F32, 16))
    a16 = builder.fmul(scales, _splat(builder, _fp16(builder, block, 208), 16))
    for n in range(2):
        lo, hi, h = _bytes(builder, block, 64 * n), _bytes(builder, block, 64 * n + 32), _bytes(builder, block, 128 + 32 * n)
        four = _same(8, LANES, 4)
        for k, (low, shift) in enumerate(((lo, 0), (hi, 2), (builder.lshr(lo, four), 4), (builder.lshr(hi, four), 6))):
            top = builder.shl(builder.and_(builder.lshr(h, _same(8, LANES, shift)), _same(8, LANES, 3)), four)
            q = builder.sub(builder.or_(builder.and_(low, _same(8, LANES, 15)), top), _same(8, LANES, 32))
            s0 = 8 * n + 2 * k
            x = _load(builder, xb, 128 * n + 32 * k, VEC, 4)
            acc = _fma(builder, builder.fmul(builder.sitofp(q, VEC), x), _lanes(builder, a16, [s0] * 16 + [s0 + 1] * 16), acc)
    return acc


def _row_dot(context, builder, sig, args, block_bytes, values, block_lanes):
    """The row's blocks folded by block_lanes(builder, block pointer, x pointer, acc) -> acc, one
    <32 x float> carried across blocks and reduced once."""
    rows, xs = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
    acc = cgutils.alloca_once_value(builder, ir.Constant(VEC, None))
    with cgutils.for_range(builder, builder.extract_value(rows.shape, 0)) as loop:
        block = builder.gep(rows.data, [builder.mul(loop.index, ir.Constant(I64, block_bytes))])
        xb = builder.gep(xs.data, [builder.mul(loop.index, ir.Constant(I64, values))])
        builder.store(block_lanes(builder, block, xb, builder.load(acc)), acc)
    total = _function(builder, "llvm.vector.reduce.fadd.v32f32", F32, [F32, VEC])
    return builder.call(total, [ir.Constant(F32, 0.0), builder.load(acc)], fastmath=("reassoc",))


def _prefetching(ahead: bool):
    """Codegen of _simd.prefetch_ahead (ahead: the row 1 + (PREFETCH_BYTES - 1) // row bytes past r;
    nothing where _isa.weight_prefetch() says no) or _simd.prefetch_row (row r itself), when that
    row exists. A row's bytes are its values' (itemsize x the inner shape), found strides[0] apart:
    for a C array the same thing, for a strided one (a slot of pool.slot_views, each slot
    contiguous) the slot's own bytes."""
    def codegen(context, builder, sig, args):
        if ahead and not _isa.weight_prefetch():       # read at each compile: no hint on AMD Zen
            return context.get_dummy_value()
        w, one = context.make_array(sig.args[0])(context, builder, args[0]), ir.Constant(I64, 1)
        row_bytes = ir.Constant(I64, context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype)))
        for axis in range(1, sig.args[0].ndim):
            row_bytes = builder.mul(row_bytes, builder.extract_value(w.shape, axis))
        step, rows = builder.extract_value(w.strides, 0), builder.extract_value(w.shape, 0)
        divisor = builder.select(builder.icmp_signed(">", row_bytes, one), row_bytes, one)
        skip = builder.add(builder.sdiv(ir.Constant(I64, _simd.PREFETCH_BYTES - 1), divisor), one)
        target = context.cast(builder, args[1], sig.args[1], types.int64)
        target = builder.add(target, skip) if ahead else target
        inside = builder.and_(builder.icmp_signed("<", target, rows), builder.icmp_signed(">=", target, ir.Constant(I64, 0)))
        with builder.if_then(inside):
            start = builder.gep(builder.bitcast(w.data, I8.as_pointer()), [builder.mul(target, step)])
            prefetch_lines(builder, start, builder.add(builder.sdiv(row_bytes, ir.Constant(I64, 64)), one))
        return context.get_dummy_value()
    return codegen


def prefetch_lines(builder, start, lines):
    """One llvm.prefetch (read, keep in every cache level, data) per 64 bytes from `start` (an i8*)
    for `lines` (an i64) lines."""
    prefetch = _function(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    hint = [ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)]
    with cgutils.for_range(builder, lines) as loop:
        builder.call(prefetch, [builder.gep(start, [builder.mul(loop.index, ir.Constant(I64, 64))])] + hint)


def prefetch_span(builder, start, nbytes):
    """One llvm.prefetch per 64-byte line that the bytes [start, start + nbytes) touch (start an
    i8*, nbytes an i64 > 0): a piece of a record need not begin on a line."""
    line = ir.Constant(I64, -64)
    first = builder.and_(builder.ptrtoint(start, I64), line)
    last = builder.and_(builder.add(builder.ptrtoint(start, I64), builder.sub(nbytes, ir.Constant(I64, 1))), line)
    lines = builder.add(builder.sdiv(builder.sub(last, first), ir.Constant(I64, 64)), ir.Constant(I64, 1))
    prefetch_lines(builder, builder.inttoptr(first, I8.as_pointer()), lines)


@intrinsic
def _prefetch_ahead_of(typingctx, w, r):
    return types.none(w, r), _prefetching(True)


@intrinsic
def _prefetch_this(typingctx, w, r):
    return types.none(w, r), _prefetching(False)


def _hint(prefetch):
    """The overload of a prefetch hint: the intrinsic for an array and an integer row, else nothing."""
    def pick(w, r):
        if isinstance(w, types.Array) and w.ndim >= 1 and isinstance(r, types.Integer):
            return lambda w, r: prefetch(w, r)
        return lambda w, r: None
    return pick


overload(_simd.prefetch_ahead, inline="always")(_hint(_prefetch_ahead_of))
overload(_simd.prefetch_row, inline="always")(_hint(_prefetch_this))


def _contiguous(*arrays):
    return all(isinstance(t, types.Array) and t.layout == "C" for t in arrays)


def _register_row(plain, block_bytes, values, block_lanes):
    """`plain` compiles to the vector loop; a strided argument is copied contiguous first."""
    @intrinsic
    def vector_row(typingctx, row, xv):
        def codegen(context, builder, sig, args):
            return _row_dot(context, builder, sig, args, block_bytes, values, block_lanes)
        ok = _contiguous(row, xv) and row.dtype == types.uint8 and xv.dtype == types.float32
        return (types.float32(row, xv), codegen) if ok else None

    @overload(plain, inline="always")
    def _plain(row, xv):
        if _contiguous(row, xv):
            return lambda row, xv: vector_row(row, xv)
        return lambda row, xv: vector_row(np.ascontiguousarray(row), np.ascontiguousarray(xv))


for _plain_dot, _bytes_per_block, _values, _block in ((_simd.dot_q8_0, 34, 32, _q8_0), (_simd.dot_q4_k, 144, 256, _q4_k),
                                                     (_simd.dot_q5_k, 176, 256, _q5_k), (_simd.dot_q6_k, 210, 256, _q6_k)):
    _register_row(_plain_dot, _bytes_per_block, _values, _block)
