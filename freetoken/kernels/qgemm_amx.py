"""kernels/qgemm.py's quantized GEMM on AMX-INT8 tiles (kernels/_amx.py), for CPUs that have them
(Sapphire Rapids and later Xeons): the same tiles of 16 tokens (qgemm.tiles), the same integer
sums and the same fp32 formula per group, so the same spec (the ops' ``ref`` with int8 dots).

A work item is 16 weight rows of one expert: their blocks are unpacked once into unsigned quants
u8[16,K] and per-group coefficients (values are a*u - c), then for each of the expert's token
tiles and each group of G values one tdpbusd gives the 16 x 16 integer sums, and the fp32 pass
acc[r, lane] += a[r] * xd[lane] * (sum + xb[lane]) - c[r] * xs[lane] applies the scales. A
group's sums come out of a tile to memory, so a tdpbusd does G/4 of 16 steps' work here; it
still does in one instruction what takes the VNNI kernel 16 x G/4 vpdpbusd.

Shape legend: qgemm's, plus R = 16 rows a work item.
"""
import numpy as np

from freetoken.kernels import _amx
from freetoken.kernels._activations import silu
from freetoken.kernels._numba import HOT, SERIAL, njit, prange
from freetoken.kernels._tile_out import put, runs

R = LANES = 16                # weight rows a work item; tokens a tile (its int32 columns)


@njit(inline="always", **SERIAL)
def _unpack(row, code, r, A, a, c):
    """Row ``row`` u8[NB,S] into A[r] (u8[K], the unsigned quants in value order) and a[r],
    c[r] (f32[K/G]) for format ``code`` (4 q8_0, 7 q4_k, 8 q5_k, 9 q6_k)."""
    if code == 4:
        _amx.unpack_q8_0(row, A, np.int64(r), a, c)
    elif code == 7:
        _amx.unpack_q4_k(row, A, np.int64(r), a, c)
    elif code == 8:
        _amx.unpack_q5_k(row, A, np.int64(r), a, c)
    else:
        _amx.unpack_q6_k(row, A, np.int64(r), a, c)


@njit(**SERIAL)
def _rows_against_tiles(A, a, c, cfg, code, xt, xd, xs, xb, n0, n1, G, acc):
    """acc[n - n0] f32[R,16] = A's rows against tiles n0..n1 (A u8[R,K], a, c f32[R,K/G])."""
    K = A.shape[1]
    sums = np.empty((2, R, LANES), np.int32)
    ng = K // G
    _amx.load_config(cfg)
    for n in range(n0, n1):
        args = (A, np.int64(K), xt, np.int64(n * (K // 4) * 64), sums, a, c, np.int64(ng),
                xd, np.int64(n * (K // 32) * LANES), xs, np.int64(n * ng * LANES), xb, acc[n - n0])
        if code == 4:
            _amx.tile_q8_0(*args)
        elif code == 7:
            _amx.tile_q4_k(*args)
        elif code == 8:
            _amx.tile_q5_k(*args)
        else:
            _amx.tile_q6_k(*args)
    _amx.release()


@njit(inline="always", **SERIAL)
def _rows_of(w, code, G, cfg, t, u, m0, rows, uniq, first, A, a, c, acc):
    """acc = rows m0 .. m0 + rows of group u's expert against its tiles (unpacked into A, a, c)."""
    xt, xd, xs, xb = t
    for r in range(rows):
        _unpack(w[uniq[u], m0 + r], code, r, A, a, c)
    _rows_against_tiles(A, a, c, cfg, code, xt, xd, xs, xb, first[u], first[u + 1], G, acc)


@njit(**SERIAL)
def _item(w, code, G, cfg, t, u, rb, uniq, offs, first, res, where, bufs):
    """Rows rb*16 .. of group u's expert against its tiles, into res; when where's half is set,
    rows half + rb*16 .. too, res getting silu(row's) * half row's. bufs: the caller's two sets
    of (A, a, c, acc); rows past M are left unread garbage, their results dropped."""
    A, a, c, acc, A2, a2, c2, acc2 = bufs
    half, m0 = where[3], rb * R
    rows = min(R, (half if half else w.shape[1]) - m0)
    _rows_of(w, code, G, cfg, t, u, m0, rows, uniq, first, A, a, c, acc)
    nt, count, p0 = first[u + 1] - first[u], offs[u + 1] - offs[u], offs[u]
    if half:                    # whole rows of 16 lanes: the exp vectorizes (per value: 1.5x the GEMM)
        _rows_of(w, code, G, cfg, t, u, half + m0, rows, uniq, first, A2, a2, c2, acc2)
        for n in range(nt):
            for r in range(rows):
                for lane in range(LANES):
                    acc[n, r, lane] = silu(acc[n, r, lane]) * acc2[n, r, lane]
    for n in range(nt):
        for lane in range(min(LANES, count - n * LANES)):
            p = p0 + n * LANES + lane
            for r in range(rows):
                put(res, where, p, m0 + r, acc[n, r, lane])


@njit(**SERIAL)
def _buffer_set(K, G, most, rows):
    """(A u8[rows,K], a, c f32[rows,K/G], acc f32[most,rows,16]): one of a run's two sets."""
    return (np.empty((rows, K), np.uint8), np.empty((rows, K // G), np.float32),
            np.empty((rows, K // G), np.float32), np.empty((max(most, 1), rows, LANES), np.float32))


@njit(**HOT)
def _gemm(w, code, G, cfg, t, uniq, offs, first, res, where, n_runs):
    """qgemm._gemm's contract, 16 rows a work item, in ``n_runs`` runs of equal row ranges, each
    over every expert, expert-major (one set of buffers a run): an expert's tiles stay in L2
    for all of the run's row blocks, and no two runs write the same columns of res."""
    M, U, K = where[3] if where[3] else w.shape[1], uniq.shape[0], t[0].shape[1] * 4
    blocks = (M + R - 1) // R
    most = np.max(first[1:] - first[:-1]) if U else 0
    for run in prange(n_runs):
        bufs = _buffer_set(K, G, most, R) + _buffer_set(K, G, most, R if where[3] else 0)   # up rows': gated only
        for u in range(U):
            for rb in range(run * blocks // n_runs, (run + 1) * blocks // n_runs):
                _item(w, code, G, cfg, t, u, rb, uniq, offs, first, res, where, bufs)


def gemm(w, code, G, t, uniq, offs, first, res, where):
    """qgemm.gemm on AMX tiles for format ``code`` (groups of G values; the tiles' xb carries
    the quants' offset; the caller checked _isa.amx_int8(); where: _tile_out.into's). Formats
    qgemm.AMX_CODES only."""
    if code not in (4, 7, 8, 9):                 # qgemm.AMX_CODES (that module imports this one)
        raise ValueError(f"the AMX tiles read q8_0 and the K-quants, not format code {code}")
    _gemm(w, code, G, _amx.config(G), t, uniq, offs, first, res, where, runs(where[3] or w.shape[1], R))
    return res
