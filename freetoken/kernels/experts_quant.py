"""The routed-experts op (kernels/experts.py's contract) over quantized banks: gate_up and down as
a GGUF file stores them (kernels/qblocks.py), read block by block, never widened whole.

The spec is experts.ref on the experts dequantized by qblocks.dequantize_ref (gguf-py's
dequantize, in fp32): the blocks' values exactly, then fp32 math. The numba version here computes
the same sums in another order (a block's scale applied once to its sub-block dot product), so it
matches within fp32 rounding, as the dense numba op does.

Few tokens per expert (decode): every row is read once per call by qblocks.dot_row, in work
items of (expert, ROWS rows) as the dense GEMV does; with int8 dots (kernels/qact.py) by the
int8 ones, x rounded once per call and each pair's activation once before down. Many (prefill)
with int8 dots on a CPU with VNNI: ``gemm``, int8 tile GEMMs (kernels/qgemm.py) in passes of
about PASS_PAIRS pairs; otherwise experts._blas, each expert dequantized into its pool thread's
fp32 scratch (linear_quant.dequant_rows: one expert at a time, never a whole bank) for BLAS.

Shape legend: T tokens, H hidden, k routed, I expert width, S slots (or experts), P routed
pairs, V values per block, B block bytes.
"""
import numpy as np

from freetoken.kernels._activations import silu
from freetoken.kernels import qgemm
from freetoken.kernels._numba import HOT, SERIAL, njit, prange
from freetoken.kernels.qact import prepared, quantize, rows_dot_tokens, wants_int8
from freetoken.kernels.qformats import format_of, logical_shape
from freetoken.kernels.qinterleave import require_int8, rows_per

ROWS = 32            # rows per parallel work item, as in experts.py
GEMM_MIN_PAIRS = 6   # routed tokens per expert (mean) from which the tile GEMM beats the GEMV: a
                     # 64-expert top-8 layer of q4_k/q6_k (H 1024, I 512), 2-core Xeon, GEMV / GEMM
                     # time 0.62 at 2 tokens an expert, 1.00 at 4, 1.59 at 8, 2.18 at 16
PASS_PAIRS = 4096    # routed pairs per GEMM pass: bounds act [pairs, I] and the tiles (a prefill
                     # chunk of 8192 tokens, top-8, would otherwise hold 65536 rows of each)


@njit(**HOT)
def _gate_up(x, gu, code, int8, uniq, offs, ptok, h):
    """h[p, r] = row r of pair p's expert . x (rounded first when int8), for all 2I rows (gate,
    then up); gu uint8[S,2I,H/V,B]. A plain row loop, as the dense GEMV's: computing a gate row
    and its up row together, with the silu between, ran 1.4x slower (int8 dots, Zen 4)."""
    xa = prepared(x, code, int8)
    R = h.shape[1]
    nib = (R + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nib):
        u, r0 = item // nib, (item % nib) * ROWS
        rows_dot_tokens(gu[uniq[u]], code, int8, xa, ptok, offs[u], offs[u + 1], r0, min(r0 + ROWS, R), h, False)


@njit(**SERIAL)
def _swiglu(h, act):
    """act[p, i] = silu(h[p, i]) * h[p, I + i], on the vectorizing exp (kernels/_activations.py;
    np.exp's libm call per value was 16 us a decode call, 4096 values)."""
    I = act.shape[1]
    for p in range(act.shape[0]):
        for i in range(I):
            act[p, i] = silu(h[p, i]) * h[p, I + i]


@njit(**HOT)
def _down(act, dn, code, int8, uniq, offs, y):
    """y[h, p] = down_h . act[p] of pair p's expert (act rounded first when int8); dn
    uint8[S,H,I/V,B], y f32[H,P]."""
    aa = prepared(act, code, int8)
    H = y.shape[0]
    nhb = (H + ROWS - 1) // ROWS
    pairs = np.arange(act.shape[0])                  # pair p reads its own activation row
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        rows_dot_tokens(dn[uniq[u]], code, int8, aa, pairs, offs[u], offs[u + 1], h0, min(h0 + ROWS, H), y, True)


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


@njit(**SERIAL)
def _decode(x, gu, dn, codes, int8s, uniq, offs, ptok, pw, out):
    """out f32[T,H] = each token's experts weighted and summed, in one call from Python (each
    call and its arrays cost microseconds at decode, where a layer's experts take ~100):
    gate_up's rows, the silu, down's rows (each parallel), then _combine."""
    P, two_i, H = ptok.shape[0], gu.shape[1] * rows_per(codes[0]), dn.shape[1] * rows_per(codes[1])
    h = np.empty((P, two_i), np.float32)                        # [P,2I]
    _gate_up(x, gu, codes[0], int8s[0], uniq, offs, ptok, h)
    act = np.empty((P, two_i // 2), np.float32)                 # [P,I]
    _swiglu(h, act)
    y = np.empty((H, P), np.float32)                            # [H,P]
    _down(act, dn, codes[1], int8s[1], uniq, offs, y)
    _combine(y, ptok, pw, out)
    return out


def gemv(x, gate_up, down, uniq, offs, ptok, pw, out, dots="f32"):
    """Few tokens per expert: out f32[T,H] = each token's experts weighted and summed, for
    experts._plan's groups (uniq, offs, ptok, pw). dots: as qact.wants_int8."""
    for w in (gate_up, down):
        require_int8(w, wants_int8(w, dots))
    return _decode(x, gate_up, down, (format_of(gate_up).code, format_of(down).code),
                   (wants_int8(gate_up, dots), wants_int8(down, dots)), uniq, offs, ptok, pw, out)


def uses_gemm(gate_up, down, dots, plan) -> bool:
    """Whether experts._plan's groups go through ``gemm``: GEMM_MIN_PAIRS tokens an expert, int8
    dots on both banks, formats the tile GEMM reads, and VNNI here (qgemm.fast_here)."""
    if plan[2].shape[0] < GEMM_MIN_PAIRS * max(1, plan[0].shape[0]):
        return False
    return all(wants_int8(w, dots) and qgemm.supported(w) for w in (gate_up, down)) and qgemm.fast_here()


def _pass(q, d, gate_up, down, uniq, offs, rows, pw, out, act_of=None):
    """out f32[T,H] += each pair's expert output weighted by pw, for groups uniq of rows of the
    rounded x (q, d): gate_up's tile GEMM with the silu (a row and its up row together: no
    [P,2I] result), the activations rounded, down's tile GEMM adding into out as it goes (a
    separate pass over a [P,H] result was ~5% of a prefill). act_of(h [P,2I], uniq, offs) -> act
    f32[P,I]: another activation (experts_glu's biases and clamped SwiGLU) on the whole product."""
    P, I = rows.shape[0], logical_shape(gate_up)[1] // 2
    src, first = qgemm.lane_sources(offs, rows)
    t = qgemm.tiles(q, d, src, format_of(gate_up).code)
    if act_of is None:
        act = qgemm.gemm(gate_up, t, uniq, offs, first, np.empty((P, I), np.float32), False, swiglu=True)   # [P,I]
    else:
        act = act_of(qgemm.gemm(gate_up, t, uniq, offs, first, np.empty((P, 2 * I), np.float32), False), uniq, offs)
    qa, da, _ = quantize(act)
    t = qgemm.tiles(qa, da, qgemm.lane_sources(offs, np.arange(P, dtype=np.int32))[0], format_of(down).code)
    return qgemm.gemm(down, t, uniq, offs, first, out, False, add_to=(rows, pw))


def gemm(x, gate_up, down, uniq, offs, ptok, pw, out, act_of=None):
    """Many tokens per expert (uses_gemm): out f32[T,H] = each token's experts weighted and
    summed, for experts._plan's groups; x rounded once, the groups in passes of PASS_PAIRS;
    act_of: _pass's."""
    q, d, _ = quantize(x)
    out[:] = 0
    a = 0
    while a < uniq.shape[0]:
        b = a + 1
        while b < uniq.shape[0] and offs[b + 1] - offs[a] <= PASS_PAIRS:
            b += 1
        pairs = slice(offs[a], offs[b])
        _pass(q, d, gate_up, down, uniq[a:b], (offs[a:b + 1] - offs[a]).astype(np.int32), ptok[pairs], pw[pairs], out,
              act_of)
        a = b
    return out
