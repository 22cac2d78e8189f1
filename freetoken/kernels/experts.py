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
    Returns uniq int32[U], offs int32[U+1], ptok int32[P], pw f32[P]."""
    T, K = ids.shape
    first = np.zeros((T, K), np.bool_)
    count = np.zeros(n_slots, np.int32)
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if e >= n_slots:
                raise IndexError("expert id out of range")
            seen = False
            for jj in range(j):
                seen = seen or ids[t, jj] == e
            if e >= 0 and not seen:
                first[t, j] = True
                count[e] += 1
    uniq = np.nonzero(count)[0].astype(np.int32)
    offs = np.zeros(uniq.shape[0] + 1, np.int32)
    offs[1:] = np.cumsum(count[uniq])
    fill = np.zeros(n_slots, np.int32)
    fill[uniq] = offs[:-1]
    ptok = np.empty(offs[-1], np.int32)
    pw = np.zeros(offs[-1], np.float32)
    for t in range(T):
        for j in range(K):
            if first[t, j]:
                e = ids[t, j]
                ptok[fill[e]] = t
                for jj in range(j, K):
                    if ids[t, jj] == e:
                        pw[fill[e]] += weights[t, jj]
                fill[e] += 1
    return uniq, offs, ptok, pw


@njit(**SERIAL)
def _silu_mul(g, u):
    # the clamp keeps exp finite: fastmath assumes no infinities
    return g / (np.float32(1.0) + np.exp(min(-g, np.float32(80.0)))) * u


@njit(**HOT)
def _gemv(xs, gate_up, down, uniq, offs, ptok, pw, act, out):
    """Few-token path, each weight row read once per call. xs f32[T,L,H/L] and gate_up, down in
    the row-dot layouts of _numba; act f32[P,Ld,I/Ld] is scratch, Ld from down's layout.
    Work items are (expert, block of ROWS rows) in weight order, so each thread's static share
    of the items is one long sequential stream (the prefetcher's best case)."""
    I = gate_up.shape[1] // 2
    H = out.shape[1]
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
    pidx = np.arange(ptok.shape[0]).astype(np.int32)
    y = np.empty((H, ptok.shape[0]), np.float32)                # [H,P] per-pair down outputs
    nhb = (H + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        ps = pidx[offs[u]:offs[u + 1]]
        for h in range(h0, min(h0 + ROWS, H)):
            dots(act, ps, down[uniq[u], h], y[h, offs[u]:])
    for hb in prange(nhb):                                      # out[t] = sum_p pw[p] * y[:, p]
        for h in range(hb * ROWS, min(hb * ROWS + ROWS, H)):
            out[:, h] = 0.0
            for p in range(ptok.shape[0]):
                out[ptok[p], h] += pw[p] * y[h, p]


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
    if T < BLAS_MIN_T:
        gu, dn = weight_rows(gate_up), weight_rows(down)
        Ld = 2 if dn.dtype == np.uint32 else 1
        act = np.empty((plan[2].shape[0], Ld, down.shape[2] // Ld), np.float32)   # [P,Ld,I/Ld]
        _gemv(split_x(x, gu), gu, dn, *plan, act, out)
        return out
    return _blas(x, gate_up, down, *plan, out)
