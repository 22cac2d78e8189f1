"""The routed experts of bf16 banks read as bf16-pair rows (kernels/_numba.py weight_rows: two
bf16 values a uint32) at few tokens an expert: experts.cpu's GEMV path (experts._gemv) and the
decode layer's one call (kernels/decode_layer.py) both run ``_pairs_gemv``. The spec is
experts.ref (with bf16=True: x and the silu's output rounded to bf16 first).

Shape legend: T tokens, H hidden, I expert width, S slots, P routed pairs; rows u32[.., K/2].
"""
import numpy as np

from freetoken.kernels._activations import silu_mul
from freetoken.kernels._numba import HOT, SERIAL, dots, from_bits, narrow, njit, prange
from freetoken.kernels.experts_quant import ROWS, _combine
from freetoken.kernels.linear import dot_rows2, rows_block4, split_pairs


@njit(**HOT)
def _gate_up_pairs(xs, gate_up, uniq, offs, ptok, act):
    """_gate_up for bf16-pair rows (xs f32[T,2,H/2], gate_up u32[S,2I,H/2], act f32[P,2,I/2]):
    groups of four tokens share each row (dots); a lone token (decode) reads gate row i and up
    row i in one loop, two streams I rows apart (linear.dot_rows2)."""
    I = gate_up.shape[1] // 2
    nib = (I + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nib):
        u, i0 = item // nib, (item % nib) * ROWS
        toks = ptok[offs[u]:offs[u + 1]]
        n = toks.shape[0]
        n4 = n // 4 * 4
        g = np.empty(n, np.float32)
        v = np.empty(n, np.float32)
        w = gate_up[uniq[u]]
        for i in range(i0, min(i0 + ROWS, I)):
            if n4:
                dots(xs, toks[:n4], w[i], g)
                dots(xs, toks[:n4], w[I + i], v)
            for j in range(n4, n):
                g[j], v[j] = dot_rows2(xs[toks[j]], w, i, I + i)
            for j in range(n):
                act[offs[u] + j, i % 2, i // 2] = silu_mul(g[j], v[j])


@njit(**HOT)
def _down_pairs(act, down, uniq, offs, iota, y):
    """_down for bf16-pair rows (act f32[P,2,I/2], down u32[S,H,I/2]): groups of four pairs share
    each row (dots); the rest read a block's rows as four streams (linear.rows_block4)."""
    H = y.shape[0]
    nhb = (H + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        h1 = min(h0 + ROWS, H)
        pairs = act[offs[u]:offs[u + 1]]
        n = pairs.shape[0]
        n4 = n // 4 * 4
        w = down[uniq[u]]
        if n4:
            for h in range(h0, h1):
                dots(pairs, iota[:n4], w[h], y[h, offs[u]:])
        for j in range(n4, n):
            rows_block4(pairs[j], w, h0, h1, y[:, offs[u] + j])


@njit(**SERIAL)
def _rounded_bf16(a):
    """experts_bf16.rounded_bf16 in numba (the same bits: narrow's round to nearest even)."""
    flat, like = a.ravel(), np.empty(0, np.uint16)
    out = np.empty_like(flat)
    for i in range(flat.shape[0]):
        out[i] = from_bits(np.uint32(narrow(flat[i], like)) << np.uint32(16))
    return out.reshape(a.shape)


@njit(**SERIAL)
def _pairs_gemv(x, gu, dn, rnd, uniq, offs, ptok, pw, out):
    """_gemv on bf16-pair rows (gu u32[S,2I,H/2], dn u32[S,H,I/2]) in one numba call, x and the
    silu's output rounded to bf16 first when rnd."""
    P = ptok.shape[0]
    xs = split_pairs(_rounded_bf16(x) if rnd else x)
    act = np.empty((P, 2, dn.shape[2]), np.float32)             # [P,2,I/2]
    y = np.empty((out.shape[1], P), np.float32)                 # [H,P]
    _gate_up_pairs(xs, gu, uniq, offs, ptok, act)
    if rnd:
        act = _rounded_bf16(act)
    _down_pairs(act, dn, uniq, offs, np.arange(P).astype(np.int32), y)
    _combine(y, ptok, pw, out)
    return out
