"""Prefill attention on the CPU as tiled GEMMs with an online softmax (attention.cpu's path for a
sequence with many query tokens in the step); tests/kernels/test_attention.py.

Why not the decode kernel: it reads every key of a query's context once per (token, head) with
vector dots, 10 GFLOP/s on the 2-core Xeon, so a 4,000-token prefill of medium spent 38 of its 49 s
there. Here the `rep` query heads that share a kv group are stacked, TILE_Q tokens at a time, into
one [TILE_Q*rep, D] block; a key block of TILE_K rows is one BLAS GEMM for the scores and one for
the values, and a running max and sum (the online softmax) carry the normalisation from block to
block, so no [T, T] (or [T, context]) matrix is ever held: the largest array an item makes is one
[TILE_Q*rep, TILE_K] score block (512 KiB at rep 4), which stays in the core's L2.

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


def _sequence(s, toks, k_cache, v_cache, slot_table, tok_pos):
    """One sequence's query tokens sorted by position and its keys and values, widened once:
    (toks int[n], pos int[n], K f32[G,C,D], V f32[G,C,D]) with C = last position + 1."""
    toks = toks[np.argsort(tok_pos[toks], kind="stable")]
    pos = tok_pos[toks]
    slots = slot_table[s, :int(pos[-1]) + 1]
    k = np.ascontiguousarray(to_f32(k_cache[slots]).transpose(1, 0, 2))
    v = np.ascontiguousarray(to_f32(v_cache[slots]).transpose(1, 0, 2))
    return toks, pos, k, v


_LANES = 16      # partial maxima kept apart so the max loop vectorizes (a plain max did not: 3x)
# not fastmath=True: under nnan the exp of a NaN score came out 0 (ref: NaN)
_FAST = dict(cache=True, nogil=True, fastmath=NAN_SAFE_MATH, error_model="numpy")


@njit(inline="always", **_FAST)
def _row_max(row, n, start):
    part = np.full(_LANES, start, np.float32)
    for c0 in range(0, n // _LANES * _LANES, _LANES):
        for i in range(_LANES):
            v = row[c0 + i]
            part[i] = v if v > part[i] else part[i]
    mx = start
    for i in range(_LANES):
        mx = part[i] if part[i] > mx else mx
    for c in range(n // _LANES * _LANES, n):
        mx = row[c] if row[c] > mx else mx
    return mx


@njit(**_FAST)
def _fold_scores(S, keys0, row_pos, m, l, alpha):
    """Fold a block of scores S f32[R,Bk] (keys keys0..) into the running max m and sum l: S
    becomes exp(S - m_new) with keys past a row's own position zeroed (causal), alpha the factor
    that rescales what the earlier blocks put in the output. One pass for the max and one for
    the exps (numpy took six over S, more time than the two GEMMs); the exp vectorizes
    (logprobs._exp_neg). m starts at -1e30, so a row whose keys so far are all -inf has l = 0
    (its output 0 / 0 = NaN, as ref) and no exp(-inf + inf). The max skips a NaN score, whose exp
    is NaN: the row's l, and so its output, turn NaN."""
    R, B = S.shape
    for r in range(R):
        row = S[r]
        lim = max(0, min(B, row_pos[r] - keys0 + 1))
        mx = _row_max(row, lim, m[r])
        s = np.float32(0.0)
        for c in range(lim):
            e = _exp_neg(row[c] - mx)
            row[c] = e
            s += e
        for c in range(lim, B):
            row[c] = 0.0
        alpha[r] = _exp_neg(m[r] - mx)
        l[r] = l[r] * alpha[r] + s
        m[r] = mx


def _tile(q, seq, a, g, rep, scale, out):
    toks, pos, k, v = seq
    tt, tp = toks[a:a + TILE_Q], pos[a:a + TILE_Q]
    D = q.shape[2]
    Q = q[tt, g * rep:(g + 1) * rep].reshape(-1, D) * np.float32(scale)     # [R,D], R = n*rep
    row_pos = np.repeat(tp, rep)
    m = np.full(Q.shape[0], -1e30, np.float32)
    l = np.zeros(Q.shape[0], np.float32)
    alpha = np.empty(Q.shape[0], np.float32)
    acc = np.zeros(Q.shape, np.float32)
    for j0 in range(0, int(tp[-1]) + 1, TILE_K):
        j1 = min(int(tp[-1]) + 1, j0 + TILE_K)
        S = Q @ k[g, j0:j1].T                                            # [R,Bk]
        _fold_scores(S, j0, row_pos, m, l, alpha)
        acc *= alpha[:, None]
        _add_values(S, v[g, j0:j1], j0, int(tp[0]), row_pos, acc)
    out[tt, g * rep:(g + 1) * rep] = (acc / l[:, None]).reshape(len(tt), rep, D)


def _add_values(S, vb, j0, first, row_pos, acc):
    """acc += S @ vb for the key block j0.. (S zero past each row's position). Keys after the
    tile's first position are masked for some rows: where their value rows hold an inf or NaN,
    which times a zero weight is NaN, each row takes only its own keys."""
    cut = max(0, first + 1 - j0)             # keys before cut are in every row's context
    if cut >= vb.shape[0] or np.isfinite(vb[cut:]).all():
        acc += S @ vb
        return
    for r in range(S.shape[0]):
        n = max(0, min(vb.shape[0], int(row_pos[r]) - j0 + 1))
        acc[r] += S[r, :n] @ vb[:n]


def prefill(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, tokens):
    """attention.ref's result for the step tokens ``tokens`` (int[n], indices into q), written
    into out; the caller has checked every slot they read."""
    G = k_cache.shape[1]
    rep = q.shape[1] // G
    items = []
    for s in np.unique(tok_seq[tokens]):
        seq = _sequence(s, tokens[tok_seq[tokens] == s], k_cache, v_cache, slot_table, tok_pos)
        for a in range(0, len(seq[0]), TILE_Q):
            last = int(seq[1][min(a + TILE_Q, len(seq[0])) - 1])
            items += [(-last, len(items), seq, a, g) for g in range(G)]
    items.sort(key=lambda it: it[:2])            # longest context first: the pool's tail is short
    run_items(items, lambda it, _: _tile(q, it[2], it[3], it[4], rep, scale, out))
    return out
