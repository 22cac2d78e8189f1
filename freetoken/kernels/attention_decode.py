"""Decode attention on the CPU: the tokens of sequences with few query tokens in a step (spec:
attention.ref; called by attention.cpu; tests/kernels/test_attention.py, test_attention_sinks.py).

One decode token reads its whole context once, so the kernel is a read of the KV rows and must run
at the box's read bandwidth. What gets it nearer:
  - split-K: the context is cut into chunks and each (token, chunk) is one work item, so every
    thread of a batch-1 step reads its own share of the rows;
  - the heads of a kv group share each row read (GQA: one K row serves `rep` query heads);
  - exp is a polynomial the compiler vectorises (no vector exp library is linked in numba), and
    the max before it is reduced as integers (finite_max);
  - scores 4 heads x 4 slots at a time, one shuffle tree for their 16 sums (_simd.head_scores);
  - the weighted V rows sum in registers, 4 heads x 64 values a block (_simd.weighted_v_rows);
  - the records AHEAD slots on in the table are asked for (the table's order is no stream), a
    kv group's piece at a time as the blocks reach it, not whole records at once.
Each item keeps its chunk's max, sum and weighted V rows; a merge rescales them to the common
max, which gives the softmax over the whole context exactly (up to fp32 rounding). A sliding
window moves where a token's chunks start (they cover only its W positions); a sink is one more
partial in the merge, with no values.

Shapes: T step tokens, Hq query heads, G kv groups (rep = Hq // G), D head dim, nch chunks of
CH positions per token.

Non-finite scores follow attention.ref (the rule in attention.py): the softmax code compiles
without fastmath's no-NaN and no-inf assumptions (_numba.NAN_SAFE_MATH), a chunk whose scores are all -inf
is shifted by 0 instead of its max (its weights are then ~0, not exp(-inf + inf) = NaN), and the
merge drops only empty chunks, not one whose sum is NaN.
"""
import numpy as np

from freetoken.kernels._simd import KV_AHEAD as AHEAD, V_BLOCK, head_scores, prefetch_row, weighted_v_rows
from freetoken.kernels._numba import HOT, HOT_NAN_SAFE, SERIAL_NAN_SAFE, from_bits, njit, prange, to_bits, widen

ITEMS_PER_THREAD = 4     # work items per compute thread: chunks of uneven cost still balance
SLOT_BLOCK = 32          # slots whose V records one pass of weighted_v_rows' blocks shares in L1
MIN_CHUNK = 64           # positions: below this the per-item set-up outweighs the split
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375       # ln 2 = _LN2_HI + _LN2_LO; n * _LN2_HI is exact in fp32 for |n| < 2^14
_LN2_LO = -2.12194440e-4
_NEG_INF_KEY = np.int32(-2139095041)   # -inf's bits (0xFF800000) as finite_max orders them
_TAYLOR = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)   # e^r after the r^7/5040 term


def describe(rep: int, D: int) -> str:
    """How a decode token's attention runs for `rep` query heads a kv group and head dim D (the
    engine's start-up log and ``kernel attention``)."""
    scores = "4 heads x 4 slots a shuffle tree" if rep % 4 == 0 and D % 16 == 0 else \
        f"a dot at a time ({f'rep {rep} is no multiple of 4' if rep % 4 else f'D {D} is no multiple of 16'})"
    rows = f"4 heads x {V_BLOCK} values in registers" if D % V_BLOCK == 0 else f"slot by slot (D {D} is no multiple of {V_BLOCK})"
    return f"decode attention: scores {scores}; weighted V rows {rows}"


def chunking(T: int, C: int, threads: int) -> tuple[int, int]:
    """(CH, nch): positions per chunk and chunks per token for contexts up to C."""
    want = max(1, -(-ITEMS_PER_THREAD * threads // T))
    CH = max(MIN_CHUNK, -(-C // want))
    return CH, -(-C // CH)


@njit(**SERIAL_NAN_SAFE)
def exp_le0(x):
    """exp(x) for x <= 0 (a softmax's shifted scores), relative error < 3e-7; vectorisable:
    x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact), 2^n from the exponent
    bits, e^r by its degree-7 Taylor polynomial. NaN stays NaN; -inf gives exp(-87), ~1.6e-38."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(_LOG2E) + np.float32(0.5))
    r = (x - n * np.float32(_LN2_HI)) - n * np.float32(_LN2_LO)
    p = np.float32(1.0 / 5040)
    for c in _TAYLOR:
        p = p * r + np.float32(c)
    return p * from_bits(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))


@njit(**SERIAL_NAN_SAFE)
def finite_max(row, n):
    """The largest of row[:n] that is not NaN (-inf if none). Reduced as integers (an fp32's bits
    made to order as an int32: negatives' magnitude bits flipped), which numba vectorises; a
    float max it leaves scalar without fastmath's no-NaN (3.4x the time at 512 slots)."""
    top = _NEG_INF_KEY
    for j in range(n):
        bits = np.int32(to_bits(row[j]))
        key = bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))
        top = max(top, key if row[j] == row[j] else _NEG_INF_KEY)
    return from_bits(np.uint32(top ^ ((top >> np.int32(31)) & np.int32(0x7FFFFFFF))))


@njit(**SERIAL_NAN_SAFE)
def chunk(q, k_cache, v_cache, slots, scale, acc, ml):
    """One work item: every head q f32[G,rep,D] of a token over the KV rows at `slots`.
    acc f32[G,rep,D] = sum of exp(score - max) * V row; ml f32[G,rep,2] = (max, sum of exp).
    All kv groups of a slot in one item: a slot's rows are one contiguous record, read once and
    in order. A function of its own, not the prange body, with C-contiguous arrays, a fresh
    accumulator and rows read element by element (bf16 widened in place): each of these kept
    numba's short loops vectorised where the alternative compiled them scalar."""
    G, rep, D = q.shape
    n = slots.shape[0]
    s = np.empty((G, rep, max(n, 1)), np.float32)                 # scores, then exp weights
    scores(q, k_cache, slots, scale, s)
    for g in range(G):
        for r in range(rep):
            m = finite_max(s[g, r], n)                    # skips NaN: exp(NaN - m) is NaN
            base = m if m > np.float32(-np.inf) else np.float32(0.0)   # all -inf: weights ~0
            tot = np.float32(0.0)
            for j in range(n):
                s[g, r, j] = exp_le0(s[g, r, j] - base)
                tot += s[g, r, j]
            ml[g, r, 0], ml[g, r, 1] = m, tot
    out = np.zeros((G, rep, D), np.float32)
    weighted_rows(s, v_cache, slots, out)
    acc[...] = out


@njit(**SERIAL_NAN_SAFE)
def scores(q, k_cache, slots, scale, s):
    """s f32[G,rep,n] = scale * q . the K rows at `slots`: 4 heads x 4 slots at a time
    (_simd.head_scores) when rep is a multiple of 4, D of 16 and a row's values are contiguous;
    the rest a dot at a time."""
    G, rep, D = q.shape
    n = slots.shape[0]
    blocks = rep % 4 == 0 and D % 16 == 0 and k_cache.strides[2] == k_cache.itemsize
    done = n - n % 4 if blocks else 0
    for j in range(0, done, 4):                   # head_scores asks for the keys ahead itself
        for g in range(G):
            for r0 in range(0, rep, 4):
                head_scores(q, k_cache, slots, j, g, r0, scale, s)
    for j in range(done, n):
        slot = slots[j]
        if j + AHEAD < n:
            prefetch_row(k_cache, slots[j + AHEAD])
        for g in range(G):
            for r in range(rep):
                a = np.float32(0.0)
                for d in range(D):
                    a += q[g, r, d] * widen(k_cache[slot, g, d])
                s[g, r, j] = a * scale


@njit(**SERIAL_NAN_SAFE)
def weighted_rows(p, v_cache, slots, out):
    """out f32[G,rep,D] += the V rows at `slots` weighted by p f32[G,rep,n]: in blocks of 4 heads
    x V_BLOCK values with their sums in registers (_simd.weighted_v_rows) when D is a multiple of
    V_BLOCK and a row's values are contiguous, else slot by slot."""
    G, rep, D = out.shape
    n = slots.shape[0]
    if D % V_BLOCK == 0 and v_cache.strides[2] == v_cache.itemsize:
        for j0 in range(0, n, SLOT_BLOCK):
            j1 = min(n, j0 + SLOT_BLOCK)
            for g in range(G):
                for r0 in range(0, rep, 4):
                    for d0 in range(0, D, V_BLOCK):
                        weighted_v_rows(p, v_cache, slots, j0, j1, g, r0, d0, out)
        return
    for j in range(n):
        slot = slots[j]
        if j + AHEAD < n:
            prefetch_row(v_cache, slots[j + AHEAD])
        for g in range(G):
            for r in range(rep):
                w = p[g, r, j]
                for d in range(D):
                    out[g, r, d] += w * widen(v_cache[slot, g, d])


@njit(**HOT)
def partials(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, CH, acc, ml, window=0):
    """Every (token, chunk) item's chunk(): q f32[T,Hq,D]; k_cache, v_cache [N,G,D] bf16 bits
    or f32; acc f32[T,nch,G,rep,D]; ml f32[T,nch,G,rep,2]. A token's chunks start at its window's
    first position (window W > 0), so they cover W positions however long the context."""
    T, nch, G, rep, D = acc.shape
    qg = q.reshape(T, G, rep, D)
    for item in prange(T * nch):
        t, c = item // nch, item % nch
        lo = c * CH + (max(0, tok_pos[t] + 1 - window) if window > 0 else 0)
        hi = max(lo, min(tok_pos[t] + 1, lo + CH))
        slots = np.empty(hi - lo, np.int32)          # a copy: a slice of the table is not C-typed
        for j in range(hi - lo):
            slots[j] = slot_table[tok_seq[t], lo + j]
        chunk(qg[t], k_cache, v_cache, slots, scale, acc[t, c], ml[t, c])


@njit(**HOT_NAN_SAFE)
def merge(acc, ml, out, sinks=None):
    """out f32[T,Hq,D] = the chunks' partials rescaled to their common max and normalised. Only
    an empty chunk has sum 0; a NaN sum (a NaN or +inf score) is merged, so the output is NaN.
    sinks f32[Hq]: one more partial a head, max sinks[h], sum 1 and no values (attention.py);
    None (decode_layer's call too) compiles the sum of the chunks alone, as before sinks."""
    T, nch, G, rep, D = acc.shape
    for item in prange(T * G * rep):
        t, g, r = item // (G * rep), item // rep % G, item % rep
        h = g * rep + r
        top = np.float32(-np.inf)
        for c in range(nch):
            if ml[t, c, g, r, 1] != 0:
                top = max(top, ml[t, c, g, r, 0])
        sink = np.float32(-np.inf) if sinks is None else sinks[h]
        top = max(top, sink)               # a finite sink: top finite, den >= 1 (no score: output 0)
        for d in range(D):
            out[t, h, d] = 0.0
        den = np.float32(0.0) if sinks is None else exp_le0(sink - top)
        for c in range(nch):
            if ml[t, c, g, r, 1] != 0:
                w = exp_le0(ml[t, c, g, r, 0] - top)
                den += w * ml[t, c, g, r, 1]
                for d in range(D):
                    out[t, h, d] += w * acc[t, c, g, r, d]
        for d in range(D):
            out[t, h, d] /= den


def run(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, threads, sinks=None, window=0):
    """attention.ref's result for these tokens into out f32[T,Hq,D] (inputs checked by the caller);
    sinks f32[Hq] or None, window W (0: none). Each keyword reaches its kernel only when set, so
    the full-causal, sink-free step runs the code it ran before them (and decode_layer's)."""
    T, Hq, D = q.shape
    G = k_cache.shape[1]
    span = int(tok_pos.max()) + 1
    CH, nch = chunking(T, min(span, window) if window > 0 else span, threads)
    acc = np.empty((T, nch, G, Hq // G, D), np.float32)
    ml = np.empty((T, nch, G, Hq // G, 2), np.float32)
    partials(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, np.float32(scale), CH, acc, ml,
             *((window,) if window > 0 else ()))
    merge(acc, ml, out, *(() if sinks is None else (sinks,)))
    return out
