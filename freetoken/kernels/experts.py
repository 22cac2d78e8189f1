"""Routed SwiGLU experts; pairs: cuda/experts.cu, tests/kernels/test_experts.py,
bench/kernels/experts_cpu.py.

out[t] = sum_j weights[t,j] * down[e] @ (silu(g) * u), g, u = split(gate_up[e] @ x[t]), e = ids[t,j];
ids < 0 contribute nothing, duplicate ids in a row both count, ``out`` is overwritten.
"""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._numba import (HOT, SERIAL, dots, njit, prange, split_x, weight_rows,
                                      widen_into)

ROWS = 32       # rows per parallel work item: amortises per-item costs, still >= 8 items per thread at 16
BLAS_MIN_T = 24  # from this many tokens, widen each expert once and let BLAS do the GEMMs


def _silu(g):
    with np.errstate(over="ignore"):
        return g / (np.float32(1.0) + np.exp(-g))


def ref(x, ids, weights, gate_up, down, out=None):
    """x f32[T,H], ids int32[T,k], weights f32[T,k], gate_up [S,2I,H], down [S,H,I] -> f32[T,H]."""
    T, H = x.shape
    I = down.shape[2]
    res = np.zeros((T, H), np.float32)
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = to_f32(gate_up[e]) @ x[t]                      # [2I]
            act = _silu(h[:I]) * h[I:]                         # [I], fp32, not rounded
            res[t] += np.float32(weights[t, j]) * (to_f32(down[e]) @ act)
    if out is None:
        return res
    out[...] = res
    return out


@njit(**SERIAL)
def _plan(ids, weights, n_slots):
    """Group (token, expert) pairs by expert, ascending id; a duplicate id in a row is merged
    into its first occurrence (weights summed) so a token appears once per expert group.
    Returns uniq int32[U], offs int32[U+1], ptok int32[P], pw f32[P]. Plain loops only: they
    compile in a fraction of the time numpy calls inside numba take."""
    T, K = ids.shape
    first = np.zeros((T, K), np.bool_)
    start = np.zeros(n_slots + 1, np.int32)                     # counts, then group starts
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if e >= n_slots:
                raise IndexError("experts: expert id out of range")
            dup = False
            for jj in range(j):
                dup = dup or ids[t, jj] == e
            if e >= 0 and not dup:
                first[t, j] = True
                start[e + 1] += 1
    U = 0
    for e in range(n_slots):
        U += start[e + 1] > 0
        start[e + 1] += start[e]
    uniq = np.empty(U, np.int32)
    offs = np.empty(U + 1, np.int32)
    offs[U] = start[n_slots]
    U = 0
    for e in range(n_slots):
        if start[e + 1] > start[e]:
            uniq[U], offs[U] = e, start[e]
            U += 1
    ptok = np.empty(start[n_slots], np.int32)
    pw = np.zeros(start[n_slots], np.float32)
    for t in range(T):
        for j in range(K):
            if first[t, j]:
                e = ids[t, j]
                ptok[start[e]] = t
                for jj in range(j, K):
                    pw[start[e]] += weights[t, jj] if ids[t, jj] == e else np.float32(0.0)
                start[e] += 1
    return uniq, offs, ptok, pw


@njit(**SERIAL)
def _silu_mul(g, u):
    # the clamp keeps exp finite: fastmath assumes no infinities
    return g / (np.float32(1.0) + np.exp(min(-g, np.float32(80.0)))) * u


@njit(**HOT)
def _gate_up(xs, gate_up, uniq, offs, ptok, act):
    """act[p] = silu(g) * u for every pair p; xs f32[T,L,H/L], act f32[P,Ld,I/Ld] (layouts of
    _numba). Work items are (expert, block of ROWS rows) in weight order, so each thread's
    static share of the items is one long sequential stream, the prefetcher's best case."""
    I = gate_up.shape[1] // 2
    Ld = act.shape[1]
    nib = (I + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nib):
        u, i0 = item // nib, (item % nib) * ROWS
        toks = ptok[offs[u]:offs[u + 1]]
        g = np.empty(toks.shape[0], np.float32)
        v = np.empty(toks.shape[0], np.float32)
        for i in range(i0, min(i0 + ROWS, I)):
            dots(xs, toks, gate_up[uniq[u], i], g)
            dots(xs, toks, gate_up[uniq[u], I + i], v)
            for j in range(toks.shape[0]):
                act[offs[u] + j, i % Ld, i // Ld] = _silu_mul(g[j], v[j])


@njit(**HOT)
def _down(act, down, uniq, offs, iota, y):
    """y[h, p] = down[e_p, h] . act[p]; items as in _gate_up; iota int32[>=P] = 0, 1, 2, ..."""
    H = y.shape[0]
    nhb = (H + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        pairs = act[offs[u]:offs[u + 1]]
        rows = iota[:pairs.shape[0]]
        for h in range(h0, min(h0 + ROWS, H)):
            dots(pairs, rows, down[uniq[u], h], y[h, offs[u]:])


@njit(**SERIAL)
def _combine(y, ptok, pw, out):
    """out[t] = sum over pairs p of token t of pw[p] * y[:, p]; serial: P*H adds are noise next
    to the weight stream."""
    for t in range(out.shape[0]):
        for h in range(out.shape[1]):
            out[t, h] = 0.0
    for h in range(y.shape[0]):
        for p in range(ptok.shape[0]):
            out[ptok[p], h] += pw[p] * y[h, p]


def _gemv(x, gate_up, down, uniq, offs, ptok, pw, out):
    """Few tokens (decode): every weight row is read once per call, by the numba row dots."""
    gu, dn = weight_rows(gate_up), weight_rows(down)
    Ld = 2 if dn.dtype == np.uint32 else 1
    P = ptok.shape[0]
    act = np.empty((P, Ld, down.shape[2] // Ld), np.float32)     # [P,Ld,I/Ld]
    y = np.empty((out.shape[1], P), np.float32)                   # [H,P]
    _gate_up(split_x(x, gu), gu, uniq, offs, ptok, act)
    _down(act, dn, uniq, offs, np.arange(P, dtype=np.int32), y)
    _combine(y, ptok, pw, out)
    return out


def _blas(x, gate_up, down, uniq, offs, ptok, pw, out):
    """Prefill path: per expert, widen its weights once into fp32 buffers and run two GEMMs."""
    I = down.shape[2]
    wgu = np.empty(gate_up.shape[1:], np.float32)             # [2I,H]
    wd = np.empty(down.shape[1:], np.float32)                  # [H,I]
    out[...] = 0.0
    for u, e in enumerate(uniq):
        tok = ptok[offs[u]:offs[u + 1]]
        gu = _as_f32(gate_up[e], wgu)
        h = x[tok] @ gu.T                                      # [n,2I]
        act = _silu(h[:, :I]) * h[:, I:]                       # [n,I]
        out[tok] += pw[offs[u]:offs[u + 1], None] * (act @ _as_f32(down[e], wd).T)
    return out


def _as_f32(w, buf):
    if w.dtype == np.float32:
        return w
    widen_into(w, buf)
    return buf


def cpu(x, ids, weights, gate_up, down, out=None):
    """Same contract as ``ref``; numba GEMVs for few tokens, per-expert BLAS for many."""
    x = np.ascontiguousarray(x, np.float32)
    T, H = x.shape
    assert gate_up.shape[2] == H and down.shape[1] == H and gate_up.shape[1] == 2 * down.shape[2]
    assert gate_up.flags.c_contiguous and down.flags.c_contiguous and gate_up.dtype == down.dtype
    if out is None:
        out = np.empty((T, H), np.float32)
    plan = _plan(np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(weights, np.float32),
                 gate_up.shape[0])
    return (_gemv if T < BLAS_MIN_T else _blas)(x, gate_up, down, *plan, out)
