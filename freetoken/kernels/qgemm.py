"""Many tokens against quantized weights as an int8 GEMM: the prefill path of the linear and
experts ops over a GGUF file's blocks when the dots are int8 (kernels/qact.py) and the CPU has
VNNI. The tokens' rounded activations are laid out in tiles of 16 (``tiles``), and each weight
row is multiplied against all of its tiles by ``_simd.itile_*`` (kernels/_simd_itile.py): every
block unpacked once per call, 16 exact integer sums per vpdpbusd. Before it, prefill dequantized
each expert to fp32 for BLAS (linear_quant.dequant_rows), a quarter of a Q4_K_M prefill.

Spec: as the GEMV's int8 dots (the dequantized weight against the rounded x, q * d), so the ops'
``ref`` with ``dots="int8"`` is the spec here too; fp32 math in another order.

Shape legend: T tokens (or rows of x), K inputs, M weight rows, V values per block, B block
bytes, P routed pairs, U experts used, N tiles of 16 lanes, G values per group (32; 16: q2_k, q3_k, q6_k).
"""
import numpy as np

from freetoken.kernels._activations import silu
from freetoken.kernels._numba import HOT, SERIAL, njit, prange
from freetoken.kernels._tile_out import into, put, runs
from freetoken.kernels._simd import (itile_mxfp4, itile_q2_k, itile_q3_k, itile_q4_0, itile_q4_1, itile_q4_k,
                                     itile_q5_0, itile_q5_1, itile_q5_k, itile_q6_k, itile_q8_0)
from freetoken.kernels.qformats import format_of, is_quantized

LANES = 16                                   # tokens per tile (the lanes of one vpdpbusd)
ROWS = 32                                    # weight rows per parallel work item
GROUPS = {4: (32, 128), 7: (32, 0), 8: (32, 0), 9: (16, 32), 11: (32, 12),   # format code -> (G, offset of u)
          0: (32, 8), 1: (32, 0), 2: (32, 16), 3: (32, 0), 5: (16, 0), 6: (16, 4)}
AMX_CODES = (4, 7, 8, 9)   # formats the AMX tiles read (kernels/qgemm_amx.py refuses others); the rest take the VNNI tiles there


def supported(w) -> bool:
    """Whether w is in a format the tile GEMM reads (every GGUF block format)."""
    return is_quantized(w) and format_of(w).code in GROUPS


def fast_here() -> bool:
    """Whether this CPU runs the tile GEMM on VNNI (elsewhere its widening fallback is exact but
    slower than dequantize + BLAS, so the ops keep that; the start-up log says which)."""
    from freetoken.kernels._isa import host, int8_tile_path
    return int8_tile_path(host()[1]) != "generic"


@njit(**HOT)
def _fill_tiles(q, q32, d, src, G, off, xt32, xd, xs, xb):
    """Tile lane n*16 + l holds x's row src[n*16 + l] (or zeros: src < 0): its rounded values
    4 at a time (q32 i32[T,K/4] into xt32 i32[N,K/4,16]: q and xt as words), scales, and per G
    values xs = d * sum(q), xb = -off * sum(q)."""
    for n in prange(xt32.shape[0]):
        for lane in range(LANES):
            t = src[n * LANES + lane]
            if t < 0:
                xt32[n, :, lane] = 0
                xd[n, :, lane] = 0
                xs[n, :, lane] = 0
                xb[n, :, lane] = 0
                continue
            qrow32, drow, qrow = q32[t], d[t], q[t]           # row views: 2-D indexing compiled to gathers
            for k in range(qrow32.shape[0]):
                xt32[n, k, lane] = qrow32[k]
            for j in range(drow.shape[0]):
                xd[n, j, lane] = drow[j]
            for g in range(xs.shape[1]):
                group, total = qrow[g * G:g * G + G], np.int32(0)
                for i in range(G):
                    total += np.int32(group[i])
                xs[n, g, lane] = drow[(g * G) // 32] * np.float32(total)
                xb[n, g, lane] = -off * total


def tiles(q, d, src, code):
    """The tiles of rows src (int32[N*16], -1 for empty lanes) of a rounded x (q i8[T,K], d
    f32[T,K/32]) for a weight in format `code`: (xt i8[N,K/4,16,4], xd, xs, xb)."""
    G, off = GROUPS[code]
    n, K = src.shape[0] // LANES, q.shape[1]
    xt = np.empty((n, K // 4, LANES, 4), np.int8)
    xd = np.empty((n, K // 32, LANES), np.float32)
    xs, xb = np.empty((n, K // G, LANES), np.float32), np.empty((n, K // G, LANES), np.int32)
    q = np.ascontiguousarray(q)
    _fill_tiles(q, q.view(np.int32), np.ascontiguousarray(d), src, G, off,
                xt.view(np.int32).reshape(n, K // 4, LANES), xd, xs, xb)
    return xt, xd, xs, xb


def lane_sources(offs, rows):
    """(src int32[N*16], first int64[U+1]): group u's lanes start at tile first[u], its rows
    rows[offs[u]:offs[u+1]] in order, its last tile padded with -1."""
    counts = np.diff(offs)
    first = np.concatenate([[0], np.cumsum((counts + LANES - 1) // LANES)]).astype(np.int64)
    src = np.full(int(first[-1]) * LANES, -1, np.int32)
    for u in range(counts.shape[0]):
        src[first[u] * LANES:first[u] * LANES + counts[u]] = rows[offs[u]:offs[u + 1]]
    return src, first


@njit(inline="always", **SERIAL)
def _itile(row, code, xt, xd, xs, xb, first, out):
    if code == 4:
        itile_q8_0(row, xt, xd, xs, xb, first, out)
    elif code == 7:
        itile_q4_k(row, xt, xd, xs, xb, first, out)
    elif code == 8:
        itile_q5_k(row, xt, xd, xs, xb, first, out)
    elif code == 11:
        itile_mxfp4(row, xt, xd, xs, xb, first, out)
    elif code == 9:
        itile_q6_k(row, xt, xd, xs, xb, first, out)
    else:
        _itile_low(row, code, xt, xd, xs, xb, first, out)


@njit(inline="always", **SERIAL)
def _itile_low(row, code, xt, xd, xs, xb, first, out):
    """_itile of the low-bit and legacy formats."""
    if code == 0:
        itile_q4_0(row, xt, xd, xs, xb, first, out)
    elif code == 1:
        itile_q4_1(row, xt, xd, xs, xb, first, out)
    elif code == 2:
        itile_q5_0(row, xt, xd, xs, xb, first, out)
    elif code == 3:
        itile_q5_1(row, xt, xd, xs, xb, first, out)
    elif code == 5:
        itile_q2_k(row, xt, xd, xs, xb, first, out)
    else:
        itile_q3_k(row, xt, xd, xs, xb, first, out)


@njit(inline="always", **SERIAL)   # called, not inlined: 1.85x the time of a Q4_K_M prefill on Zen 4
def _rows(w, code, t, u, m0, m1, uniq, offs, first, res, where, out, out2):
    """Rows m0..m1 of group u's expert (and half + m0.. when where's half is set) against all
    of its tiles, into res."""
    xt, xd, xs, xb = t
    p0, count = offs[u], offs[u + 1] - offs[u]
    for n in range(first[u], first[u + 1]):        # a tile's 16 tokens stay in L1 for all rows
        lanes = min(LANES, count - (n - first[u]) * LANES)
        p = p0 + (n - first[u]) * LANES
        for m in range(m0, m1):
            _itile(w[uniq[u], m], code, xt, xd, xs, xb, n, out)
            if where[3]:                           # all 16 lanes: the exp vectorizes
                _itile(w[uniq[u], where[3] + m], code, xt, xd, xs, xb, n, out2)
                for j in range(LANES):
                    out[0, j] = silu(out[0, j]) * out2[0, j]
            for j in range(lanes):
                put(res, where, p + j, m, out[0, j])


@njit(**HOT)
def _gemm(w, code, t, uniq, offs, first, res, where, n_runs):
    """For group u (weights w[uniq[u]] u8[M,K/V,B]), its lane j's product with row m goes to
    res as ``put`` says, pair p = offs[u] + j. In ``n_runs`` runs of equal
    row ranges, each over every group in turn: a group's tiles stay in L2 for the run's rows."""
    M, U = where[3] if where[3] else w.shape[1], uniq.shape[0]
    chunks = (M + ROWS - 1) // ROWS
    for run in prange(n_runs):
        out, out2 = np.empty((1, LANES), np.float32), np.empty((1, LANES), np.float32)
        for u in range(U):
            for c in range(run * chunks // n_runs, (run + 1) * chunks // n_runs):
                _rows(w, code, t, u, c * ROWS, min(c * ROWS + ROWS, M), uniq, offs, first, res, where, out, out2)


def gemm(w, t, uniq, offs, first, res, rows_first, add_to=None, swiglu=False):
    """Each group's weights against its tiles t (``tiles``, lanes from ``lane_sources``): w
    [S,M,K/V,B] (a quantized bank, groups reading slots uniq) -> res f32[M,P] when rows_first,
    else [P,M]; with add_to = (ptok, pw), res f32[T,M] += pw[p] * pair p's product at row
    ptok[p] instead; swiglu: the products of rows m < M/2 become silu(row m's) * row M/2 + m's
    (M/2 columns). On AMX tiles where the CPU has them (_isa.amx_int8, kernels/qgemm_amx.py)."""
    from freetoken.kernels._isa import amx_int8
    code, where = format_of(w).code, into(rows_first, add_to, w.shape[1] // 2 if swiglu else 0)
    if amx_int8() and code in AMX_CODES:
        from freetoken.kernels import qgemm_amx
        return qgemm_amx.gemm(w, code, GROUPS[code][0], t, uniq, offs, first, res, where)
    return vnni(w, code, t, uniq, offs, first, res, where)


def vnni(w, code, t, uniq, offs, first, res, where):
    """``gemm`` on the VNNI tiles whatever the CPU has (format ``code``; where: ``into``'s)."""
    _gemm(w, code, t, uniq, offs, first, res, where, runs(where[3] or w.shape[1], ROWS))
    return res
