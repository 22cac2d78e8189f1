"""The routed-experts op (kernels/experts.py's contract) over quantized banks: gate_up and down as
a GGUF file stores them (kernels/qblocks.py), read block by block, never widened whole.

The spec is experts.ref on the experts dequantized by qblocks.dequantize_ref (gguf-py's
dequantize, in fp32): the blocks' values exactly, then fp32 math. The numba version here computes
the same sums in another order (a block's scale applied once to its sub-block dot product), so it
matches within fp32 rounding, as the dense numba op does.

Few tokens per expert (decode): every row is read once per call by qblocks.dot_row, in work
items of (expert, ROWS rows) as the dense GEMV does; with int8 dots (kernels/qact.py) by
qblocks.idot_row, x rounded once per call and each pair's activation once before down. Many (prefill): experts._blas, each expert
dequantized into its pool thread's fp32 scratch (linear_quant.dequant_rows: one expert at a time,
never a whole bank) and multiplied by BLAS.

Shape legend: T tokens, H hidden, k routed, I expert width, S slots (or experts), P routed
pairs, V values per block, B block bytes.
"""
import numpy as np

from freetoken.kernels._activations import silu_mul
from freetoken.kernels._numba import HOT, njit, prange
from freetoken.kernels.qact import dot_token, prepare, wants_int8
from freetoken.kernels.qformats import format_of

ROWS = 32            # rows per parallel work item, as in experts.py


@njit(**HOT)
def _gate_up(xa, gu, code, int8, uniq, offs, ptok, act):
    """act[p, i] = silu(gate_i . x) * (up_i . x) for every pair p; gu uint8[S,2I,H/V,B]; xa:
    qact.prepare(x)."""
    I = act.shape[1]
    nib = (I + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nib):
        u, i0 = item // nib, (item % nib) * ROWS
        e = uniq[u]
        for i in range(i0, min(i0 + ROWS, I)):
            g_row, u_row = gu[e, i], gu[e, I + i]
            for p in range(offs[u], offs[u + 1]):
                t = ptok[p]
                act[p, i] = silu_mul(dot_token(g_row, code, xa, t, int8), dot_token(u_row, code, xa, t, int8))


@njit(**HOT)
def _down(aa, dn, code, int8, uniq, offs, y):
    """y[h, p] = down_h . act[p] of pair p's expert; dn uint8[S,H,I/V,B], y f32[H,P]; aa:
    qact.prepare(act)."""
    H = y.shape[0]
    nhb = (H + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        e = uniq[u]
        for h in range(h0, min(h0 + ROWS, H)):
            row = dn[e, h]
            for p in range(offs[u], offs[u + 1]):
                y[h, p] = dot_token(row, code, aa, p, int8)


def gemv(x, gate_up, down, uniq, offs, ptok, y, dots="f32"):
    """Few tokens per expert: y f32[H,P] = each pair's expert output (unweighted) for experts._plan's
    groups (uniq, offs, ptok); experts.py weights and adds them. dots: as qact.wants_int8."""
    int8_gu, int8_dn = wants_int8(gate_up, dots), wants_int8(down, dots)
    act = np.empty((ptok.shape[0], gate_up.shape[1] // 2), np.float32)     # [P,I]
    _gate_up(prepare(x, gate_up, int8_gu), gate_up, format_of(gate_up).code, int8_gu, uniq, offs, ptok, act)
    _down(prepare(act, down, int8_dn), down, format_of(down).code, int8_dn, uniq, offs, y)
    return y
