"""Many tokens against quantized weights as an int8 GEMM: the prefill path of the linear and
experts ops over a GGUF file's blocks when the dots are int8 (kernels/qact.py) and the CPU has
VNNI. The tokens' rounded activations are laid out in tiles of 16 (``tiles``); a run of weight
rows is unpacked to bytes once (``_simd.unpack_*``), then multiplied 4 rows by 2 tiles at a time
(``_simd.igemm_g*``, kernels/_simd_igemm.py), 16 exact integer sums per vpdpbusd. Before it,
prefill dequantized each expert to fp32 for BLAS (linear_quant.dequant_rows), a quarter of a
Q4_K_M prefill.

Spec: as the GEMV's int8 dots (the dequantized weight against the rounded x, q * d), so the ops'
``ref`` with ``dots="int8"`` is the spec here too; fp32 math in another order.

Shape legend: T tokens (or rows of x), K inputs, M weight rows, V values per block, B block
bytes, P routed pairs, U experts used, N tiles of 16 lanes, G values per group (32; 16: q2_k, q3_k, q6_k).
"""
import numpy as np

from freetoken.kernels._activations import silu
from freetoken.kernels._numba import HOT, SERIAL, njit, prange
from freetoken.kernels._tile_out import into, put, runs
from freetoken.kernels._simd import (igemm_g16, igemm_g32, unpack_mxfp4, unpack_q2_k, unpack_q3_k, unpack_q4_0,
                                     unpack_q4_1, unpack_q4_k, unpack_q5_0, unpack_q5_1, unpack_q5_k, unpack_q6_k,
                                     unpack_q4_0x16, unpack_q8_0)
from freetoken.kernels.qformats import format_of, is_quantized, logical_shape
from freetoken.kernels.qinterleave import CODE as CODE_X16, rows_per

LANES = 16                                   # tokens per tile (the lanes of one vpdpbusd)
ROWS = 32                                    # weight rows per parallel work item (unpacked at once)
R = 4                                        # weight rows per igemm call
GROUPS = {4: (32, 128), 7: (32, 0), 8: (32, 0), 9: (16, 32), 11: (32, 12),   # format code -> (G, offset of u)
          0: (32, 8), 1: (32, 0), 2: (32, 16), 3: (32, 0), 5: (16, 0), 6: (16, 4),
          12: (32, 8)}                       # 12: q4_0's rows interleaved (kernels/qinterleave.py)
MINS = (1, 3, 5, 7, 8)                       # formats whose values subtract a min (q4_1, q5_1, q2_k, q4_k, q5_k)
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
def _unpack(w, m, code, u, a, c):
    """Row m of w (u8[M,K/V,B], or an interleaved u8[M/16,K/32,288]) unpacked into u, a, c."""
    if code == CODE_X16:
        unpack_q4_0x16(w[m // 16], m % 16, u, a, c)
        return
    row = w[m]
    if code == 4:
        unpack_q8_0(row, u, a, c)
    elif code == 7:
        unpack_q4_k(row, u, a, c)
    elif code == 8:
        unpack_q5_k(row, u, a, c)
    elif code == 11:
        unpack_mxfp4(row, u, a, c)
    elif code == 9:
        unpack_q6_k(row, u, a, c)
    else:
        _unpack_low(row, code, u, a, c)


@njit(inline="always", **SERIAL)
def _unpack_low(row, code, u, a, c):
    """_unpack of the low-bit and legacy formats."""
    if code == 0:
        unpack_q4_0(row, u, a, c)
    elif code == 1:
        unpack_q4_1(row, u, a, c)
    elif code == 2:
        unpack_q5_0(row, u, a, c)
    elif code == 3:
        unpack_q5_1(row, u, a, c)
    elif code == 5:
        unpack_q2_k(row, u, a, c)
    else:
        unpack_q3_k(row, u, a, c)


def kind_of(code: int) -> tuple:
    """(code, G, has_min) of a format: what _gemm's kernels read of it (GROUPS, MINS)."""
    return np.int64(code), np.int64(GROUPS[code][0]), np.int64(code in MINS)


@njit(inline="always", **SERIAL)
def _igemm(kind, un, t, r0, t0, out):
    """Unpacked rows r0 .. r0+3 of un = (u, a, c) against tiles t0 (and t0 + 1 where out has 8 rows)."""
    u, a, c = un
    xt, xd, xs, xb = t
    if kind[1] == 16:
        igemm_g16(u, a, c, xt, xd, xs, xb, r0, t0, kind[2], out)
    else:
        igemm_g32(u, a, c, xt, xd, xs, xb, r0, t0, kind[2], out)


@njit(**SERIAL)   # called, not inlined: 1.85x the time of a Q4_K_M prefill on Zen 4 (the one-row kernels)
def _rows(w, kind, t, u, m0, m1, uniq, offs, first, res, where, scratch):
    """Rows m0..m1 of group u's expert (and half + m0.. when where's half is set) against all
    of its tiles, into res: unpacked once, then 4 rows by 2 tiles a call."""
    un, out, out2 = scratch
    half, rows, p0, count = where[3], m1 - m0, offs[u], offs[u + 1] - offs[u]
    for j in range(rows):
        _unpack(w[uniq[u]], m0 + j, kind[0], un[0][j], un[1][j], un[2][j])
        if half:
            _unpack(w[uniq[u]], half + m0 + j, kind[0], un[0][ROWS + j], un[1][ROWS + j], un[2][ROWS + j])
    for n in range(first[u], first[u + 1], 2):    # the tiles stay in L1 for the run's rows
        pair = min(2, first[u + 1] - n)
        o, o2 = out[:R * pair], out2[:R * pair]
        for r in range(0, rows, R):               # rows past m1 are the last run's or zeros: not put
            _igemm(kind, un, t, r, n, o)
            if half:                              # all 16 lanes: the exp vectorizes
                _igemm(kind, un, t, ROWS + r, n, o2)
                for i in range(R * pair):
                    for j in range(LANES):
                        o[i, j] = silu(o[i, j]) * o2[i, j]
            _put_rows(res, where, o, min(R, rows - r), pair, m0 + r, p0 + (n - first[u]) * LANES,
                      count - (n - first[u]) * LANES)


@njit(inline="always", **SERIAL)
def _put_rows(res, where, o, rows, pair, m, p, left):
    """o[j*pair + k, i] (row m + j, tile k's lane i: pair p + k*16 + i, `left` pairs from p on) into
    res; where res's rows are the pairs (or tokens), its 4 adjacent columns per pair in turn."""
    for k in range(pair):
        lanes = min(LANES, left - k * LANES)
        if where[0] == 1:
            for j in range(rows):
                for i in range(lanes):
                    put(res, where, p + k * LANES + i, m + j, o[j * pair + k, i])
        else:
            for i in range(lanes):
                for j in range(rows):
                    put(res, where, p + k * LANES + i, m + j, o[j * pair + k, i])


@njit(**HOT)
def _gemm(w, kind, t, uniq, offs, first, res, where, n_runs):
    """For group u (weights w[uniq[u]] u8[M,K/V,B], the format ``kind_of`` gives), its lane j's
    product with row m goes to res as ``put`` says, pair p = offs[u] + j. In ``n_runs`` runs of equal
    row ranges, each over every group in turn: a group's tiles stay in L2 for the run's rows."""
    M = where[3] if where[3] else w.shape[1] * rows_per(kind[0])
    U, K, groups = uniq.shape[0], t[0].shape[1] * 4, t[2].shape[1]
    chunks = (M + ROWS - 1) // ROWS
    for run in prange(n_runs):
        un = (np.zeros((2 * ROWS, K), np.uint8), np.zeros((2 * ROWS, groups), np.float32),
              np.zeros((2 * ROWS, groups), np.float32))
        scratch = (un, np.empty((2 * R, LANES), np.float32), np.empty((2 * R, LANES), np.float32))
        for u in range(U):
            for c in range(run * chunks // n_runs, (run + 1) * chunks // n_runs):
                _rows(w, kind, t, u, c * ROWS, min(c * ROWS + ROWS, M), uniq, offs, first, res, where, scratch)


def gemm(w, t, uniq, offs, first, res, rows_first, add_to=None, swiglu=False):
    """Each group's weights against its tiles t (``tiles``, lanes from ``lane_sources``): w
    [S,M,K/V,B] (a quantized bank, groups reading slots uniq) -> res f32[M,P] when rows_first,
    else [P,M]; with add_to = (ptok, pw), res f32[T,M] += pw[p] * pair p's product at row
    ptok[p] instead; swiglu: the products of rows m < M/2 become silu(row m's) * row M/2 + m's
    (M/2 columns). On AMX tiles where the CPU has them (_isa.amx_int8, kernels/qgemm_amx.py)."""
    from freetoken.kernels._isa import amx_int8
    code, where = format_of(w).code, into(rows_first, add_to, logical_shape(w)[1] // 2 if swiglu else 0)
    if amx_int8() and code in AMX_CODES:
        from freetoken.kernels import qgemm_amx
        return qgemm_amx.gemm(w, code, GROUPS[code][0], t, uniq, offs, first, res, where)
    return vnni(w, code, t, uniq, offs, first, res, where)


def vnni(w, code, t, uniq, offs, first, res, where):
    """``gemm`` on the VNNI tiles whatever the CPU has (format ``code``; where: ``into``'s)."""
    _gemm(w, kind_of(code), t, uniq, offs, first, res, where, runs(where[3] or logical_shape(w)[1], ROWS))
    return res
