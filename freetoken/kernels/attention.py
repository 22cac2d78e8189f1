"""Causal GQA attention over the token-slot KV pool; pairs: cuda/attention.cu,
tests/kernels/test_attention.py.

Token t of sequence s = tok_seq[t] at position p = tok_pos[t] attends to the cached rows at slots
slot_table[s, 0..p] (inclusive); query head h reads kv group h // (Hq // G). One layout covers
prefill, chunked prefill over a cached prefix, decode, and batches of sequences mixed in a step.
"""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._numba import HOT, axpy, dot, njit, prange, split_x, weight_rows


def ref(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out=None):
    """q f32[T,Hq,D], k_cache, v_cache [N,G,D], slot_table int32[B,C], tok_seq, tok_pos int32[T]
    -> f32[T,Hq,D]; scores = (q . k) * scale, softmax in fp32."""
    T, Hq, D = q.shape
    rep = Hq // k_cache.shape[1]
    res = np.empty((T, Hq, D), np.float32)
    for t in range(T):
        slots = slot_table[tok_seq[t], :tok_pos[t] + 1]
        k = to_f32(k_cache[slots])                               # [n,G,D]
        v = to_f32(v_cache[slots])
        for h in range(Hq):
            s = (k[:, h // rep] @ q[t, h].astype(np.float32)) * np.float32(scale)   # [n]
            p = np.exp(s - s.max())
            res[t, h] = (p / p.sum()) @ v[:, h // rep]
    if out is None:
        return res
    out[...] = res
    return out


@njit(**HOT)
def _attention(qs, k_rows, v_rows, slot_table, tok_seq, tok_pos, scale, out):
    """Parallel over (token, head): scores into a buffer, max, then exp-weighted V rows.
    qs f32[T,Hq,L,D/L]; k_rows, v_rows [N,G,D/L] in the row-dot layouts of _numba."""
    T, Hq, L, W = qs.shape
    rep = Hq // k_rows.shape[1]
    for item in prange(T * Hq):
        t, h = item // Hq, item % Hq
        g = h // rep
        slots = slot_table[tok_seq[t], :tok_pos[t] + 1]
        s = np.empty(slots.shape[0], np.float32)
        m = np.float32(-np.inf)
        for j in range(slots.shape[0]):
            s[j] = dot(qs[t, h], k_rows[slots[j], g]) * scale
            m = max(m, s[j])
        acc = np.empty((L, W), np.float32)                       # [L,D/L]
        for ll in range(L):     # a loop: np.zeros here would compile as a nested parfor
            for i in range(W):
                acc[ll, i] = 0.0
        tot = np.float32(0.0)
        for j in range(slots.shape[0]):
            p = np.exp(s[j] - m)
            tot += p
            axpy(p, v_rows[slots[j], g], acc)
        for i in range(W):
            for ll in range(L):
                out[t, h, i * L + ll] = acc[ll, i] / tot


def _check(q, k_cache, slot_table, tok_seq, tok_pos):
    """The kernel does not bounds-check: validate every slot it will read, once per sequence."""
    T, Hq, D = q.shape
    N, G, _ = k_cache.shape
    assert k_cache.shape[2] == D and Hq % G == 0, (q.shape, k_cache.shape)
    if T == 0:
        return
    B, C = slot_table.shape
    if not (0 <= tok_seq.min() and tok_seq.max() < B and 0 <= tok_pos.min() and tok_pos.max() < C):
        raise IndexError("attention: tok_seq or tok_pos outside slot_table")
    for s in np.unique(tok_seq):
        used = slot_table[s, :tok_pos[tok_seq == s].max() + 1]
        if not (0 <= used.min() and used.max() < N):
            raise IndexError(f"attention: sequence {s} reads a slot outside [0, {N})")


def cpu(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out=None):
    """Same contract as ``ref``."""
    q = np.ascontiguousarray(q, np.float32)
    slot_table = np.ascontiguousarray(slot_table, np.int32)
    tok_seq = np.ascontiguousarray(tok_seq, np.int32)
    tok_pos = np.ascontiguousarray(tok_pos, np.int32)
    _check(q, k_cache, slot_table, tok_seq, tok_pos)
    if out is None:
        out = np.empty(q.shape, np.float32)
    k_rows, v_rows = weight_rows(k_cache), weight_rows(v_cache)
    assert k_rows.dtype == v_rows.dtype, "k and v caches must share a dtype"
    _attention(split_x(q, k_rows), k_rows, v_rows, slot_table, tok_seq, tok_pos,
               np.float32(scale), out)
    return out
