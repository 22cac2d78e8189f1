"""The LLVM IR of decode attention's two halves in kernels/_simd.py, ``head_scores`` and
``weighted_v_rows``, and their numba overloads. Imported only by _simd.register, once numba is
loaded. Measured one thread, a hot 512-slot chunk of 4 kv groups x 4 heads, D 64, Xeon EMR VM:
the whole chunk 106 us in numba, 40 us with both.

Scores: numba ends each dot of D values in a horizontal sum. Here 4 heads x 4 slots keep 16
partial vectors over D (4 K loads and 4 q loads feed 16 fused multiply-adds a step), and one
shuffle tree (each level adds the two halves of every vector, pairing neighbours) turns them into
one vector of the 16 scores.

Weighted V rows: numba keeps an accumulator array in memory (it cannot prove it apart from the KV
cache), so each product loaded and stored its sum (310 us of a 4,096-slot chunk). Here 4 heads x
64 values of D stay in 16 <16 x float> registers across a run of slots: each slot loads its 64 V
values once, broadcasts 4 weights and adds 16 fused multiply-adds.

bf16 is widened by a shift into an fp32's top half. Shapes: q f32[G,rep,D]; k, v [N,G,D] bf16 bits
(u16) or f32, the values of a (slot, group) contiguous; slots i32[n]; s, p f32[G,rep,M] (scores,
then the softmax weights; j < n used); out f32[G,rep,D]. D a multiple of 16 (scores), 64 (V).
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from freetoken.kernels import _simd
from freetoken.kernels._simd_ir import F32, I32, I64, I8, _contiguous, _function, _same, _splat, prefetch_span

ROWS, LANES, VECTORS = 4, 16, 4          # a block: up to 4 heads x 64 values (4 vectors of 16)
F32x16 = ir.VectorType(F32, LANES)


def _v_values(builder, at, bf16, vectors=VECTORS):
    """The 16 x `vectors` values at `at` (an i8*) as <16 x float>s: bf16 bits shifted to an fp32's
    top half."""
    kind, width = (ir.IntType(16), 2) if bf16 else (F32, 4)
    count, vectors = vectors, []
    for i in range(count):
        ptr = builder.bitcast(builder.gep(at, [ir.Constant(I64, i * LANES * width)]), ir.VectorType(kind, LANES).as_pointer())
        loaded = builder.load(ptr, align=width)
        if bf16:
            loaded = builder.bitcast(builder.shl(builder.zext(loaded, ir.VectorType(I32, LANES)), _same(32, LANES, 16)), F32x16)
        vectors.append(loaded)
    return vectors


def _rows_codegen(context, builder, sig, args):
    """The loop over slots j0 .. j1-1 with 4 heads x 4 vectors of sums; heads past rep (the last
    block of a rep not divisible by 4) are computed on head r0's weights and not stored. A block
    at r0 = 0 also asks, each slot, for its own piece (group g, values d0..) of the record
    KV_AHEAD slots on: the caller's blocks of the other heads run over the same pieces next."""
    p, v, slots, out = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 2, 8))
    j0, j1, g, r0, d0 = args[3:8]
    bf16, c = sig.args[1].dtype == types.uint16, lambda value: ir.Constant(I64, value)  # noqa: E731
    rep, depth, m = (builder.extract_value(a.shape, i) for a, i in ((out, 1), (out, 2), (p, 2)))
    real = [builder.icmp_signed("<", builder.add(r0, c(r)), rep) for r in range(ROWS)]
    heads = [builder.add(builder.mul(g, rep), builder.select(real[r], builder.add(r0, c(r)), r0)) for r in range(ROWS)]
    weights = [builder.gep(p.data, [builder.mul(h, m)]) for h in heads]
    sums = [builder.bitcast(builder.gep(out.data, [builder.add(builder.mul(h, depth), d0)]), F32x16.as_pointer())
            for h in heads]
    accs = [[cgutils.alloca_once_value(builder, builder.load(builder.gep(s, [c(i)]), align=4)) for i in range(VECTORS)]
            for s in sums]
    base, step = builder.bitcast(v.data, I8.as_pointer()), builder.extract_value(v.strides, 0)
    in_record = builder.add(builder.mul(g, builder.extract_value(v.strides, 1)), builder.mul(d0, c(2 if bf16 else 4)))
    piece = c(_simd.V_BLOCK * (2 if bf16 else 4))
    first, n = builder.icmp_signed("==", r0, c(0)), builder.extract_value(slots.shape, 0)

    def record_of(j):
        return builder.gep(base, [builder.mul(builder.sext(builder.load(builder.gep(slots.data, [j])), I64), step)])
    with cgutils.for_range_slice(builder, j0, j1, c(1)) as (j, _):
        ahead = builder.add(j, c(_simd.KV_AHEAD))
        with builder.if_then(builder.and_(first, builder.icmp_signed("<", ahead, n))):
            prefetch_span(builder, builder.gep(record_of(ahead), [in_record]), piece)
        values = _v_values(builder, builder.gep(record_of(j), [in_record]), bf16)
        for r in range(ROWS):
            w = _splat(builder, builder.load(builder.gep(weights[r], [j])), LANES)
            for i in range(VECTORS):
                builder.store(_fma16(builder, w, values[i], builder.load(accs[r][i])), accs[r][i])
    for r in range(ROWS):
        with builder.if_then(real[r]):
            for i in range(VECTORS):
                builder.store(builder.load(accs[r][i]), builder.gep(sums[r], [c(i)]), align=4)
    return context.get_dummy_value()


def _fma16(builder, a, b, c):
    return builder.call(_function(builder, "llvm.fma.v16f32", F32x16, [F32x16] * 3), [a, b, c])


@intrinsic
def _weighted_v_block(typingctx, p, v, slots, j0, j1, g, r0, d0, out):
    ok = (_contiguous(p, slots, out) and isinstance(v, types.Array) and v.ndim == 3
          and v.dtype in (types.uint16, types.float32) and p.dtype == out.dtype == types.float32
          and slots.dtype == types.int32 and j0 == j1 == g == r0 == d0 == types.int64)
    return (types.none(p, v, slots, j0, j1, g, r0, d0, out), _rows_codegen) if ok else None


@overload(_simd.weighted_v_rows, inline="always")
def _plain(p, v, slots, j0, j1, g, r0, d0, out):
    return lambda p, v, slots, j0, j1, g, r0, d0, out: _weighted_v_block(p, v, slots, j0, j1, g, r0, d0, out)


def _tree_sum(builder, vectors):
    """One <16 x float> whose lane i is the sum of vectors[i]'s 16 lanes (16 vectors): each level
    adds the two halves of every item, pairing neighbours (16 items of 16 lanes -> 16 of 1)."""
    width = LANES
    while len(vectors) > 1:
        half, pairs = width // 2, []
        for a, b in zip(vectors[::2], vectors[1::2]):
            items = [(src, at) for src in (0, 1) for at in range(0, LANES, width)]
            low = [src * LANES + at + i for src, at in items for i in range(half)]
            high = [x + half for x in low]
            pick = lambda lanes: builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, LANES), lanes))  # noqa: E731
            pairs.append(builder.fadd(pick(low), pick(high)))
        vectors, width = pairs, half
    return vectors[0]


def _keys_ahead(builder, k, slots, j0, g, r0, width):
    """At r0 = 0: ask for group g's key piece (`width` bytes) of the 4 records KV_AHEAD slots past
    j0 (those that exist). Piece by piece as the blocks run, not whole records at the top of a
    step (a burst of 36-68 lines): measured faster from memory (docs/performance.md); that the
    burst outran the core's miss buffers and lost hints is our reading, not measured."""
    c, n = (lambda value: ir.Constant(I64, value)), builder.extract_value(slots.shape, 0)  # noqa: E731
    base, step = builder.bitcast(k.data, I8.as_pointer()), builder.extract_value(k.strides, 0)
    in_record = builder.mul(g, builder.extract_value(k.strides, 1))
    with builder.if_then(builder.icmp_signed("==", r0, c(0))):
        for u in range(ROWS):
            ahead = builder.add(j0, c(_simd.KV_AHEAD + u))
            with builder.if_then(builder.icmp_signed("<", ahead, n)):
                slot = builder.sext(builder.load(builder.gep(slots.data, [ahead])), I64)
                prefetch_span(builder, builder.gep(base, [builder.add(builder.mul(slot, step), in_record)]), width)


def _scores_codegen(context, builder, sig, args):
    """s[g, r0+h, j0+u] = scale * q[g, r0+h] . k[slots[j0+u], g] for 4 heads h and 4 slots u: 16
    partial vectors over D, 16 lanes a step, then one shuffle tree instead of 16 horizontal sums.
    The block at r0 = 0 asks for the keys of the slots KV_AHEAD on (_keys_ahead)."""
    q, k, slots, s = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 2, 7))
    j0, g, r0, scale = args[3], args[4], args[5], args[6]
    bf16, c = sig.args[1].dtype == types.uint16, lambda value: ir.Constant(I64, value)  # noqa: E731
    rep, depth, m = (builder.extract_value(a.shape, i) for a, i in ((q, 1), (q, 2), (s, 2)))
    heads = [builder.add(builder.mul(g, rep), builder.add(r0, c(h))) for h in range(ROWS)]
    q_rows = [builder.gep(q.data, [builder.mul(h, depth)]) for h in heads]
    base, step = builder.bitcast(k.data, I8.as_pointer()), builder.extract_value(k.strides, 0)
    in_record = builder.mul(g, builder.extract_value(k.strides, 1))
    records = [builder.gep(base, [builder.add(builder.mul(builder.sext(builder.load(builder.gep(
        slots.data, [builder.add(j0, c(u))])), I64), step), in_record)]) for u in range(ROWS)]
    _keys_ahead(builder, k, slots, j0, g, r0, builder.mul(depth, c(2 if bf16 else 4)))
    parts = [cgutils.alloca_once_value(builder, ir.Constant(F32x16, None)) for _ in range(ROWS * ROWS)]
    with cgutils.for_range_slice(builder, c(0), depth, c(LANES)) as (d, _):
        keys = [_v_values(builder, builder.gep(rec, [builder.mul(d, c(2 if bf16 else 4))]), bf16, 1)[0] for rec in records]
        for h in range(ROWS):
            qv = builder.load(builder.bitcast(builder.gep(q_rows[h], [d]), F32x16.as_pointer()), align=4)
            for u in range(ROWS):
                part = parts[h * ROWS + u]
                builder.store(_fma16(builder, qv, keys[u], builder.load(part)), part)
    total = builder.fmul(_tree_sum(builder, [builder.load(p) for p in parts]), _splat(builder, scale, LANES))
    for h in range(ROWS):
        four = builder.shuffle_vector(total, total, ir.Constant(ir.VectorType(I32, ROWS), list(range(h * 4, h * 4 + 4))))
        at = builder.gep(s.data, [builder.add(builder.mul(heads[h], m), j0)])
        builder.store(four, builder.bitcast(at, ir.VectorType(F32, ROWS).as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic
def _scores_block(typingctx, q, k, slots, j0, g, r0, scale, s):
    ok = (_contiguous(q, slots, s) and isinstance(k, types.Array) and k.ndim == 3
          and k.dtype in (types.uint16, types.float32) and q.dtype == s.dtype == scale == types.float32
          and slots.dtype == types.int32 and j0 == g == r0 == types.int64)
    return (types.none(q, k, slots, j0, g, r0, scale, s), _scores_codegen) if ok else None


@overload(_simd.head_scores, inline="always")
def _plain_scores(q, k, slots, j0, g, r0, scale, s):
    return lambda q, k, slots, j0, g, r0, scale, s: _scores_block(q, k, slots, j0, g, r0, scale, s)
