"""The routed experts of bf16 banks read as bf16-pair rows (kernels/_numba.py weight_rows: two
bf16 values a uint32) at few tokens an expert: experts.cpu's GEMV path (experts._gemv) and the
decode layer's one call (kernels/decode_layer.py) both run ``_pairs_gemv``. The spec is
experts.ref (with bf16=True: x and the silu's output rounded to bf16 first).

Rounded to bf16 (the default, --cpu-dots int8) on a CPU with AVX512-BF16, the inputs go in as bf16
words too and each row dot is _simd.bdot_rows2/4 (vdpbf16ps); elsewhere, and unrounded (--cpu-dots
f32), as fp32 halves (_gate_up_pairs, _down_pairs: rows widened once for four tokens).

Shape legend: T tokens, H hidden, I expert width, S slots, P routed pairs; rows u32[.., K/2].
"""
import numpy as np

from freetoken.kernels._activations import silu_mul
from freetoken.kernels._numba import HOT, SERIAL, dots, from_bits, narrow, njit, prange
from freetoken.kernels._simd import bdot_rows2, bdot_rows4, bf16_dots_here, prefetch_ahead
from freetoken.kernels.experts_bf16 import _pair
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
def _bf16_words(a):
    """a f32[T,K] rounded to bf16 -> u32[T,K/2], two values a word (experts_bf16._pair, as the
    prefill tiles pack them): the activation layout of bdot_rows2/4."""
    like = np.empty(0, np.uint16)
    words = np.empty((a.shape[0], a.shape[1] // 2), np.uint32)
    for t in range(a.shape[0]):
        for k in range(words.shape[1]):
            words[t, k] = _pair(a[t, 2 * k], a[t, 2 * k + 1], like)
    return words


@njit(**HOT)
def _gate_up_words(xw, gate_up, uniq, offs, ptok, act):
    """_gate_up_pairs on bf16 words (xw u32[T,H/2], act f32[P,I]): gate row i and up row i read
    together (two streams I rows apart), by each of the expert's tokens in turn (from L1 after
    the first)."""
    I = gate_up.shape[1] // 2
    nib = (I + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nib):
        u, i0 = item // nib, (item % nib) * ROWS
        w = gate_up[uniq[u]]
        for i in range(i0, min(i0 + ROWS, I)):
            prefetch_ahead(w, i)
            prefetch_ahead(w, I + i)
            for p in range(offs[u], offs[u + 1]):
                g, v = bdot_rows2(w, xw[ptok[p]], i, I + i)
                act[p, i] = silu_mul(g, v)


@njit(**HOT)
def _down_words(aw, down, uniq, offs, y):
    """_down_pairs on bf16 words (aw u32[P,I/2], y f32[H,P]): a block's rows as four streams a
    quarter block apart (a short last block's last row read again in place of rows past it)."""
    H = y.shape[0]
    nhb = (H + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        last = min(h0 + ROWS, H) - 1
        q = (last - h0 + 4) // 4
        w = down[uniq[u]]
        for h in range(h0, h0 + q):
            r1, r2, r3 = min(h + q, last), min(h + 2 * q, last), min(h + 3 * q, last)
            for r in (h, r1, r2, r3):
                prefetch_ahead(w, r)
            for p in range(offs[u], offs[u + 1]):
                y[h, p], y[r1, p], y[r2, p], y[r3, p] = bdot_rows4(w, aw[p], h, r1, r2, r3)


@njit(**SERIAL)
def _pairs_gemv(x, gu, dn, rnd, uniq, offs, ptok, pw, out):
    """_gemv on bf16-pair rows (gu u32[S,2I,H/2], dn u32[S,H,I/2]) in one numba call, x and the
    silu's output rounded to bf16 first when rnd."""
    P = ptok.shape[0]
    if rnd and bf16_dots_here():
        act = np.empty((P, 2 * dn.shape[2]), np.float32)        # [P,I]
        y = np.empty((out.shape[1], P), np.float32)             # [H,P]
        _gate_up_words(_bf16_words(x), gu, uniq, offs, ptok, act)
        _down_words(_bf16_words(act), dn, uniq, offs, y)
        _combine(y, ptok, pw, out)
        return out
    xs = split_pairs(_rounded_bf16(x) if rnd else x)
    act = np.empty((P, 2, dn.shape[2]), np.float32)             # [P,2,I/2]
    y = np.empty((out.shape[1], P), np.float32)                 # [H,P]
    _gate_up_pairs(xs, gu, uniq, offs, ptok, act)
    if rnd:
        act = _rounded_bf16(act)
    _down_pairs(act, dn, uniq, offs, np.arange(P).astype(np.int32), y)
    _combine(y, ptok, pw, out)
    return out
