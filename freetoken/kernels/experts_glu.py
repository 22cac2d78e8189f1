"""The routed experts with per-expert biases and gpt-oss's clamped SwiGLU (experts.py's ``bias=`` and
``glu=``): the clamped SwiGLU in numpy (``clamped_swiglu``: experts.ref's and experts._blas's),
experts.cpu's int8 tile GEMM for many tokens per expert of quantized banks (``tile_gemm``:
experts_quant's passes with ``_glu`` between the two products), and its path for few tokens per
expert (``gemv``), the general one of every bank kind:

  h = gate_up rows . x for each routed pair (dense: experts._down's pair-row dots over x gathered
  per pair; quantized: ``_q_rows``), then ``_glu`` (+ gate_up bias, the SwiGLU, into act f32[P,I]),
  down's rows the same way, + down bias, experts_quant._combine.

Compiled for it: ``_glu`` (serial; one specialisation for every bank kind: alpha and limit float32
values, ``clamped`` a flag) and ``_q_rows`` (one for every format); the dense dots are the plain
GEMV's own kernel with its own argument types. experts_quant's _gate_up and _down are not called
from here: a kernel compiled against a parallel kernel that numba loaded from its cache is cached
broken (its _decode, so compiled, segfaulted on its next load: numba issue 8578), and a call from
Python would cache them apart from their caller. The specialised decode paths (experts_pairs, the
quantized decode in one call) have neither keyword.

Shape legend: T tokens, H hidden, I expert width, S slots, P routed pairs.
"""
import numpy as np

from freetoken.kernels._activations import sigmoid, silu
from freetoken.kernels._numba import HOT, SERIAL, njit, prange, split_x, weight_rows
from freetoken.kernels.experts_bf16 import rounded_bf16
from freetoken.kernels.experts_quant import ROWS, _combine
from freetoken.kernels.qact import prepared, rows_dot_tokens, wants_int8
from freetoken.kernels.qformats import format_of, is_quantized, logical_shape
from freetoken.kernels.qinterleave import require_int8

_ONE = np.float32(1.0)


def clamped_swiglu(g, u, alpha, limit):
    """gpt-oss's SwiGLU (transformers' GptOssExperts._apply_gate) in fp32: g = min(g, limit),
    u = clip(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""
    alpha, limit = np.float32(alpha), np.float32(limit)
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    with np.errstate(over="ignore"):
        return (u + _ONE) * (g / (_ONE + np.exp(-alpha * g)))


def biases(bias, S, I, H):
    """``bias`` as contiguous f32 arrays (gate_up's [S,2I], down's [S,H]), or None."""
    if bias is None:
        return None
    gub, dnb = (np.ascontiguousarray(b, np.float32) for b in bias)
    check_biases(gub, dnb, S, I, H)
    return gub, dnb


def check_biases(gub, dnb, S, I, H) -> None:
    """ValueError unless gate_up's biases are [S,2I] and down's [S,H] (host or device arrays)."""
    if gub.shape != (S, 2 * I) or dnb.shape != (S, H):
        raise ValueError(f"experts: biases {gub.shape} and {dnb.shape}, expected {(S, 2 * I)} and {(S, H)}")


@njit(**SERIAL)
def _glu(h, by_row, gub, pe, alpha, limit, clamped, act):
    """act[p, i] = the SwiGLU of pair p's gate h[i] and up h[I + i] (h f32[2I,P] when by_row, else
    [P,2I]), each plus row pe[p] of gub f32[S,2I] when gub has rows; clamped: gpt-oss's with
    (alpha, limit), else silu(g) * u."""
    P, I = act.shape
    for p in range(P):
        for i in range(I):
            g = h[i, p] if by_row else h[p, i]
            u = h[I + i, p] if by_row else h[p, I + i]
            if gub.shape[0]:
                g += gub[pe[p], i]
                u += gub[pe[p], I + i]
            if clamped:
                g = min(g, limit)
                u = min(max(u, -limit), limit)
                act[p, i] = (u + _ONE) * g * sigmoid(alpha * g)
            else:
                act[p, i] = silu(g) * u


@njit(**HOT)
def _q_rows(x, toks, w, code, int8, uniq, offs, out):
    """out[p, r] = row r of w[e] . x[toks[p]] (x rounded first when int8) for the pairs p of each
    group (uniq, offs); w quantized [S,R,K/V,B], out f32[P,R]: experts_quant's _gate_up."""
    xa = prepared(x, code, int8)
    R = out.shape[1]
    nrb = (R + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nrb):
        u, r0 = item // nrb, (item % nrb) * ROWS
        rows_dot_tokens(w[uniq[u]], code, int8, xa, toks, offs[u], offs[u + 1], r0, min(r0 + ROWS, R), out, False)


def _quantized(x, gate_up, down, plan, dots, act_of, y):
    """y f32[H,P] = down rows . act of quantized banks, act = act_of(h [P,2I], False)."""
    uniq, offs, ptok, _ = plan
    P = ptok.shape[0]
    for w in (gate_up, down):
        require_int8(w, wants_int8(w, dots))
    h = np.empty((P, logical_shape(gate_up)[1]), np.float32)                    # [P,2I]
    _q_rows(x, ptok, gate_up, format_of(gate_up).code, wants_int8(gate_up, dots), uniq, offs, h)
    yt = np.empty((P, y.shape[0]), np.float32)                                  # [P,H]
    _q_rows(act_of(h, False), np.arange(P, dtype=np.int32), down, format_of(down).code, wants_int8(down, dots),
            uniq, offs, yt)                                                     # rounds act when int8
    y[...] = yt.T


def _dense(x, gate_up, down, plan, bf16, act_of, y, pair_rows):
    """y f32[H,P] for bf16 or fp32 banks by experts._down's pair-row dots (``pair_rows``), read as
    the plain GEMV reads them (_numba.weight_rows); x and act rounded to bf16 first under bf16."""
    uniq, offs, ptok, _ = plan
    gu, dn = weight_rows(gate_up), weight_rows(down)
    iota = np.arange(ptok.shape[0], dtype=np.int32)
    h = np.empty((gate_up.shape[1], ptok.shape[0]), np.float32)                 # [2I,P]
    pair_rows(split_x((rounded_bf16(x) if bf16 else x)[ptok], gu), gu, uniq, offs, iota, h)
    act = act_of(h, True)
    pair_rows(split_x(rounded_bf16(act) if bf16 else act, dn), dn, uniq, offs, iota, y)


def _glu_args(bias, glu, I) -> tuple:
    """_glu's gub (empty without biases), alpha and limit (f32), clamped."""
    gub = bias[0] if bias is not None else np.empty((0, 2 * I), np.float32)
    alpha, limit = (np.float32(v) for v in (glu if glu is not None else (0.0, 0.0)))
    return gub, alpha, limit, glu is not None


def tile_gemm(x, gate_up, down, plan, out, bias, glu):
    """experts.cpu with ``bias`` or ``glu`` at many tokens per expert on quantized banks with int8
    dots (experts_quant.uses_gemm): the int8 tile GEMM's passes with ``_glu`` between gate_up's
    product and down's; down's bias as one product of the routing weights per expert [T,S] and
    the biases [S,H]."""
    from freetoken.kernels import experts_quant
    uniq, offs, ptok, pw = plan
    gub, alpha, limit, clamped = _glu_args(bias, glu, logical_shape(down)[2])

    def act_of(h, uniq, offs):
        act = np.empty((h.shape[0], h.shape[1] // 2), np.float32)
        _glu(h, False, gub, np.repeat(uniq, np.diff(offs)), alpha, limit, clamped, act)
        return act

    experts_quant.gemm(x, gate_up, down, uniq, offs, ptok, pw, out, act_of)
    if bias is not None:
        routing = np.zeros((out.shape[0], bias[1].shape[0]), np.float32)       # [T,S]
        np.add.at(routing, (ptok, np.repeat(uniq, np.diff(offs))), pw)
        out += routing @ bias[1]
    return out


def gemv(x, gate_up, down, plan, out, dots, bf16, bias, glu, pair_rows):
    """experts.cpu with ``bias`` (biases()) or ``glu`` at few tokens per expert: out f32[T,H] for
    experts._plan's groups ``plan``; dots as qact.wants_int8, bf16 as experts_bf16.wants_bf16
    (already asked), pair_rows experts._down (passed in: this module is below experts.py)."""
    uniq, offs, ptok, pw = plan
    P, I = ptok.shape[0], logical_shape(down)[2]
    if P == 0:
        out[...] = 0.0
        return out
    pe = np.repeat(uniq, np.diff(offs))                                         # each pair's expert
    gub, alpha, limit, clamped = _glu_args(bias, glu, I)

    def act_of(h, by_row):
        act = np.empty((P, I), np.float32)
        _glu(h, by_row, gub, pe, alpha, limit, clamped, act)
        return act

    y = np.empty((out.shape[1], P), np.float32)                                 # [H,P]
    if is_quantized(gate_up):
        _quantized(x, gate_up, down, plan, dots, act_of, y)
    else:
        _dense(x, gate_up, down, plan, bf16, act_of, y, pair_rows)
    if bias is not None:
        y += bias[1][pe].T
    _combine(y, ptok, pw, out)
    return out
