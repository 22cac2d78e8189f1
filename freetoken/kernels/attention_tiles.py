"""Prefill attention on the CPU as tiled GEMMs with an online softmax (attention.cpu's path for a
sequence with many query tokens in the step); tests/kernels/test_attention.py, test_attention_sinks.py.

Why not the decode kernel: it reads every key of a query's context once per (token, head) with
vector dots, 10 GFLOP/s on the 2-core Xeon, so a 4,000-token prefill of medium spent 38 of its 49 s
there. Here the `rep` query heads that share a kv group are stacked, TILE_Q tokens at a time, into
one [TILE_Q*rep, D] block; a key block of TILE_K rows is one BLAS GEMM for the scores and one for
the values, and a running max and sum (the online softmax) carry the normalisation from block to
block, so no [T, T] (or [T, context]) matrix is ever held: the largest array an item makes is one
[TILE_Q*rep, TILE_K] score block (512 KiB at rep 4), which stays in the core's L2.

A sliding window masks the keys before each row's window start in the same fold, and a query
tile's key blocks start at its first row's window start (cost ~W + TILE_Q keys a row, not the
prefix); a sink joins the sum when the tile's rows are normalised (_normalised).

Work items are (sequence, query tile, kv group), longest context first, run by the BLAS pool
(kernels/_blas_pool.py); each writes its own rows and heads of ``out``.

Non-finite data follows attention.ref (the rule in attention.py): the score code compiles without
fastmath's no-NaN and no-inf assumptions, and a value row a query may not see never meets its
zero weight in the GEMM (0 * inf is NaN: see _add_values).
"""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._blas_pool import run_items
from freetoken.kernels._numba import NAN_SAFE_MATH, njit
from freetoken.kernels.logprobs import _exp_neg

TILE_Q = 128      # query tokens per item: x rep heads = the GEMMs' rows
TILE_K = 512      # keys per online-softmax step: a [512, 512] f32 score block is 1 MiB, in L2


def _sequence(s, toks, k_cache, v_cache, slot_table, tok_pos, window):
    """One sequence's query tokens sorted by position and its keys and values, widened once:
    (toks int[n], pos int[n], K f32[G,C,D], V f32[G,C,D], base), the rows of positions base..last,
    base the earliest a query reads (0 without a window)."""
    toks = toks[np.argsort(tok_pos[toks], kind="stable")]
    pos = tok_pos[toks]
    base = max(0, int(pos[0]) - window + 1) if window > 0 else 0
    slots = slot_table[s, base:int(pos[-1]) + 1]
    k = np.ascontiguousarray(to_f32(k_cache[slots]).transpose(1, 0, 2))
    v = np.ascontiguousarray(to_f32(v_cache[slots]).transpose(1, 0, 2))
    return toks, pos, k, v, base


_LANES = 16      # partial maxima kept apart so the max loop vectorizes (a plain max did not: 3x)
# not fastmath=True: under nnan the exp of a NaN score came out 0 (ref: NaN)
_FAST = dict(cache=True, nogil=True, fastmath=NAN_SAFE_MATH, error_model="numpy")


@njit(inline="always", **_FAST)
def _row_max(row, lo, hi, start):
    part = np.full(_LANES, start, np.float32)
    for c0 in range(lo, lo + (hi - lo) // _LANES * _LANES, _LANES):
        for i in range(_LANES):
            v = row[c0 + i]
            part[i] = v if v > part[i] else part[i]
    mx = start
    for i in range(_LANES):
        mx = part[i] if part[i] > mx else mx
    for c in range(lo + (hi - lo) // _LANES * _LANES, hi):
        mx = row[c] if row[c] > mx else mx
    return mx


@njit(**_FAST)
def _fold_scores(S, keys0, row_first, row_pos, m, l, alpha):
    """Fold a block of scores S f32[R,Bk] (keys keys0..) into the running max m and sum l: S
    becomes exp(S - m_new) with keys outside a row's row_first..row_pos zeroed (window, causal),
    alpha the factor that rescales what the earlier blocks put in the output. One pass for the
    max and one for the exps (numpy took six over S, more time than the two GEMMs); the exp
    vectorizes (logprobs._exp_neg). m starts at -1e30, so a row whose keys so far are all -inf
    has l = 0 (its output 0 / 0 = NaN, as ref) and no exp(-inf + inf). The max skips a NaN score,
    whose exp is NaN: the row's l, and so its output, turn NaN."""
    R, B = S.shape
    for r in range(R):
        row = S[r]
        lo = max(0, min(B, row_first[r] - keys0))
        lim = max(lo, min(B, row_pos[r] - keys0 + 1))
        mx = _row_max(row, lo, lim, m[r])
        row[:lo] = 0.0
        s = np.float32(0.0)
        seg = row[lo:]            # the exps' sum from index 0 of a view: without a window the code, and
        for c in range(lim - lo):  # so its order of adding, stays what it was before windows
            e = _exp_neg(seg[c] - mx)
            seg[c] = e
            s += e
        row[lim:] = 0.0
        alpha[r] = _exp_neg(m[r] - mx)
        l[r] = l[r] * alpha[r] + s
        m[r] = mx


def _tile(q, seq, a, g, rep, scale, out, sinks, window):
    toks, pos, k, v, base = seq
    tt, tp = toks[a:a + TILE_Q], pos[a:a + TILE_Q]
    D = q.shape[2]
    Q = q[tt, g * rep:(g + 1) * rep].reshape(-1, D) * np.float32(scale)     # [R,D], R = n*rep
    row_pos = np.repeat(tp, rep)
    row_first = np.maximum(row_pos - window + 1, 0) if window > 0 else np.zeros_like(row_pos)
    m = np.full(Q.shape[0], -1e30, np.float32)
    l = np.zeros(Q.shape[0], np.float32)
    alpha = np.empty(Q.shape[0], np.float32)
    acc = np.zeros(Q.shape, np.float32)
    end = int(tp[-1]) + 1
    for j0 in range(int(row_first[0]), end, TILE_K):   # rows sorted: the first window starts first
        j1 = min(end, j0 + TILE_K)
        S = Q @ k[g, j0 - base:j1 - base].T                              # [R,Bk]
        _fold_scores(S, j0, row_first, row_pos, m, l, alpha)
        acc *= alpha[:, None]
        _add_values(S, v[g, j0 - base:j1 - base], j0, (int(row_first[-1]), int(tp[0])), row_first, row_pos, acc)
    sink = None if sinks is None else np.tile(sinks[g * rep:(g + 1) * rep], len(tt))
    out[tt, g * rep:(g + 1) * rep] = _normalised(acc, l, m, sink).reshape(len(tt), rep, D)


def _normalised(acc, l, m, sink):
    """acc / l: the rows' outputs; a sink f32[R] adds exp(sink - max) to the sum, both sides taken
    to the larger of the row's max m and its sink (a row with no finite score gets 0, not NaN)."""
    if sink is None:
        return acc / l[:, None]
    top = np.maximum(m, sink)
    w = np.exp(m - top)
    return acc * (w / (l * w + np.exp(sink - top)))[:, None]


def _add_values(S, vb, j0, shared, row_first, row_pos, acc):
    """acc += S @ vb for the key block j0.. (S zero outside each row's window). Keys outside
    shared = (lo, hi), the positions in every row's window, are masked for some rows: where their
    value rows hold an inf or NaN, which times a zero weight is NaN, each row takes only its own keys."""
    a, b = max(0, shared[0] - j0), max(0, shared[1] + 1 - j0)
    if np.isfinite(vb[:a]).all() and np.isfinite(vb[b:]).all():
        acc += S @ vb
        return
    for r in range(S.shape[0]):
        lo = max(0, int(row_first[r]) - j0)
        n = max(lo, min(vb.shape[0], int(row_pos[r]) - j0 + 1))
        acc[r] += S[r, lo:n] @ vb[lo:n]


def prefill(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, tokens, sinks=None, window=0):
    """attention.ref's result for the step tokens ``tokens`` (int[n], indices into q), written
    into out; the caller has checked every slot they read. sinks f32[Hq] or None, window W."""
    G = k_cache.shape[1]
    rep = q.shape[1] // G
    items = []
    for s in np.unique(tok_seq[tokens]):
        seq = _sequence(s, tokens[tok_seq[tokens] == s], k_cache, v_cache, slot_table, tok_pos, window)
        for a in range(0, len(seq[0]), TILE_Q):
            last = int(seq[1][min(a + TILE_Q, len(seq[0])) - 1])
            items += [(-last, len(items), seq, a, g) for g in range(G)]
    items.sort(key=lambda it: it[:2])            # longest context first: the pool's tail is short
    run_items(items, lambda it, _: _tile(q, it[2], it[3], it[4], rep, scale, out, sinks, window))
    return out
