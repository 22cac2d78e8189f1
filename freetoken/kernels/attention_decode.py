"""Decode attention on the CPU: the tokens of sequences with few query tokens in a step (spec:
attention.ref; called by attention.cpu; tests/kernels/test_attention.py).

One decode token reads its whole context once, so the kernel is a read of the KV rows and must run
at the box's read bandwidth. Four things get it there:
  - split-K: the context is cut into chunks and each (token, chunk) is one work item, so every
    thread of a batch-1 step reads its own share of the rows;
  - the heads of a kv group share each row read (GQA: one K row serves `rep` query heads);
  - exp is a polynomial the compiler vectorises (no vector exp library is linked in numba);
  - the records AHEAD slots on in the table are asked for (the table's order is no stream).
Each item keeps its chunk's max, sum and weighted V rows; a merge rescales them to the common
max, which gives the softmax over the whole context exactly (up to fp32 rounding).

Shapes: T step tokens, Hq query heads, G kv groups (rep = Hq // G), D head dim, nch chunks of
CH positions per token.

Non-finite scores follow attention.ref (the rule in attention.py): the softmax code compiles
without fastmath's no-NaN and no-inf assumptions (_numba.NAN_SAFE_MATH), a chunk whose scores are all -inf
is shifted by 0 instead of its max (its weights are then ~0, not exp(-inf + inf) = NaN), and the
merge drops only empty chunks, not one whose sum is NaN.
"""
import numpy as np

from freetoken.kernels._simd import prefetch_row
from freetoken.kernels._numba import HOT, HOT_NAN_SAFE, SERIAL_NAN_SAFE, from_bits, njit, prange, widen

ITEMS_PER_THREAD = 4     # work items per compute thread: chunks of uneven cost still balance
AHEAD = 8                # KV records asked for ahead of the one read (prefetch_row)
MIN_CHUNK = 64           # positions: below this the per-item set-up outweighs the split
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375       # ln 2 = _LN2_HI + _LN2_LO; n * _LN2_HI is exact in fp32 for |n| < 2^14
_LN2_LO = -2.12194440e-4
_TAYLOR = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)   # e^r after the r^7/5040 term


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
    for j in range(n):
        slot = slots[j]
        if j + AHEAD < n:
            prefetch_row(k_cache, slots[j + AHEAD])
        for g in range(G):
            for r in range(rep):
                a = np.float32(0.0)
                for d in range(D):
                    a += q[g, r, d] * widen(k_cache[slot, g, d])
                s[g, r, j] = a * scale
    for g in range(G):
        for r in range(rep):
            m = np.float32(-np.inf)
            for j in range(n):
                m = max(m, s[g, r, j])                   # skips NaN: exp(NaN - m) is NaN
            base = m if m > np.float32(-np.inf) else np.float32(0.0)   # all -inf: weights ~0
            tot = np.float32(0.0)
            for j in range(n):
                s[g, r, j] = exp_le0(s[g, r, j] - base)
                tot += s[g, r, j]
            ml[g, r, 0], ml[g, r, 1] = m, tot
    out = np.zeros((G, rep, D), np.float32)
    for j in range(n):
        slot = slots[j]
        if j + AHEAD < n:
            prefetch_row(v_cache, slots[j + AHEAD])
        for g in range(G):
            for r in range(rep):
                p = s[g, r, j]
                for d in range(D):
                    out[g, r, d] += p * widen(v_cache[slot, g, d])
    acc[...] = out


@njit(**HOT)
def partials(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, CH, acc, ml):
    """Every (token, chunk) item's chunk(): q f32[T,Hq,D]; k_cache, v_cache [N,G,D] bf16 bits
    or f32; acc f32[T,nch,G,rep,D]; ml f32[T,nch,G,rep,2]."""
    T, nch, G, rep, D = acc.shape
    qg = q.reshape(T, G, rep, D)
    for item in prange(T * nch):
        t, c = item // nch, item % nch
        lo = c * CH
        hi = max(lo, min(tok_pos[t] + 1, lo + CH))
        slots = np.empty(hi - lo, np.int32)          # a copy: a slice of the table is not C-typed
        for j in range(hi - lo):
            slots[j] = slot_table[tok_seq[t], lo + j]
        chunk(qg[t], k_cache, v_cache, slots, scale, acc[t, c], ml[t, c])


@njit(**HOT_NAN_SAFE)
def merge(acc, ml, out):
    """out f32[T,Hq,D] = the chunks' partials rescaled to their common max and normalised. Only
    an empty chunk has sum 0; a NaN sum (a NaN or +inf score) is merged, so the output is NaN."""
    T, nch, G, rep, D = acc.shape
    for item in prange(T * G * rep):
        t, g, r = item // (G * rep), item // rep % G, item % rep
        h = g * rep + r
        top = np.float32(-np.inf)
        for c in range(nch):
            if ml[t, c, g, r, 1] != 0:
                top = max(top, ml[t, c, g, r, 0])
        for d in range(D):
            out[t, h, d] = 0.0
        den = np.float32(0.0)
        for c in range(nch):
            if ml[t, c, g, r, 1] != 0:
                w = exp_le0(ml[t, c, g, r, 0] - top)
                den += w * ml[t, c, g, r, 1]
                for d in range(D):
                    out[t, h, d] += w * acc[t, c, g, r, d]
        for d in range(D):
            out[t, h, d] /= den


def run(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, threads):
    """attention.ref's result for these tokens into out f32[T,Hq,D] (inputs checked by the caller)."""
    T, Hq, D = q.shape
    G = k_cache.shape[1]
    CH, nch = chunking(T, int(tok_pos.max()) + 1, threads)
    acc = np.empty((T, nch, G, Hq // G, D), np.float32)
    ml = np.empty((T, nch, G, Hq // G, 2), np.float32)
    partials(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, np.float32(scale), CH, acc, ml)
    merge(acc, ml, out)
    return out
