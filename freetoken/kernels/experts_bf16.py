"""Prefill of bf16 routed experts on AVX512-BF16 (kernels/_simd_bf16.py's vdpbf16ps tiles), for
experts.cpu under ``bf16=True`` when a prompt gives the experts many tokens each.

Spec: experts.ref with bf16=True: x and the SwiGLU output rounded to bf16 (round to nearest even)
before each bank, then the bf16 products exact in fp32 and summed in fp32 (here in another order;
denormals flushed by the instruction). Where the widened-weights BLAS path read each expert's
bf16 rows into an fp32 buffer and multiplied in fp32 (about 80 GFLOP/s a core, widening
included, Zen 4), the tiles multiply the bf16 rows as they are stored.

Layout: each expert's tokens fill whole tiles of 16 (zero lanes after the last), an even number
of tiles an expert (the kernel takes two at a time); tile_base[u] is expert u's first tile.
Shape legend: T tokens, H hidden, I expert width, U experts routed to, P pairs, NT tiles.
"""
import numpy as np

from freetoken.kernels._activations import silu
from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.kernels._numba import HOT, SERIAL, narrow, njit, prange
from freetoken.kernels._simd import btile_bf16

LANES = 16           # tokens a tile
PASS_PAIRS = 4096    # routed pairs a pass: bounds the tiles and h, as experts_quant's passes do
                     # (all of an 8192-token chunk at once held ~1.35 GB at 30B-A3B's shape)
ROWS = 32            # weight rows a work item (8 blocks of the kernel's 4)


def wants_bf16(bank, bf16: bool) -> bool:
    """Whether experts asked to round for bf16 (``bf16=True``: the cpu backend under --cpu-dots
    int8, activations rounded to the dot instruction's input type as llama.cpp rounds them) round
    their input before ``bank``: a bf16 bank."""
    return bf16 and bank.dtype == np.uint16


def rounded_bf16(a):
    """a f32 rounded to bf16 (nearest even) and widened back: the spec's rounding."""
    return to_f32(from_f32(a))


def bf16_rounding(bank, bf16: bool):
    """The rounding of an input before ``bank``: rounded_bf16, or none."""
    return rounded_bf16 if wants_bf16(bank, bf16) else (lambda a: a)


@njit(**SERIAL)
def _tiles(offs):
    """tile_base int64[U+1]: expert u's tiles are tile_base[u] .. tile_base[u+1] (even counts)."""
    base = np.zeros(offs.shape[0], np.int64)
    for u in range(offs.shape[0] - 1):
        n = (offs[u + 1] - offs[u] + LANES - 1) // LANES
        base[u + 1] = base[u] + n + (n & 1)
    return base


@njit(inline="always", **SERIAL)
def _pair(a, b, like):
    """Two fp32 values rounded to bf16, as one word: a in the low half (the even element)."""
    return np.uint32(narrow(a, like)) | (np.uint32(narrow(b, like)) << np.uint32(16))


@njit(**HOT)
def _pack_x(x, ptok, offs, base, xt):
    """xt u32[NT,H/2,16]: expert u's pair j reads token ptok[offs[u] + j] in tile base[u] + j // 16,
    lane j % 16; lanes after an expert's last pair are 0. A work item a tile, not an expert: a
    call with one expert (a dense layer, a shared expert) packs on every thread."""
    like = np.empty(0, np.uint16)
    for t in prange(xt.shape[0]):
        for k in range(xt.shape[1]):
            for lane in range(LANES):
                xt[t, k, lane] = 0
    for t in prange(xt.shape[0]):
        u = np.searchsorted(base, t, side="right") - 1        # base[u] <= t < base[u + 1]
        first = (t - base[u]) * LANES
        for lane in range(min(LANES, offs[u + 1] - offs[u] - first)):   # none in a padding tile
            row = x[ptok[offs[u] + first + lane]]
            for k in range(xt.shape[1]):
                xt[t, k, lane] = _pair(row[2 * k], row[2 * k + 1], like)


@njit(**HOT)
def _bank(w, uniq, base, xt, out):
    """out f32[R,NT,16] = each routed expert's rows (w u32[S,R,K/2]) against its own tiles."""
    R = w.shape[1]
    nrb = (R + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nrb):
        u, r0 = item // nrb, (item % nrb) * ROWS
        rows = w[uniq[u]]
        for r in range(r0, min(r0 + ROWS, R), 4):
            for t in range(base[u], base[u + 1], 2):
                btile_bf16(rows, xt, np.int64(r), np.int64(t), out)


@njit(**HOT)
def _swiglu_pack(h, at):
    """at u32[NT,I/2,16] = silu(gate) * up of h f32[2I,NT,16], rounded to bf16 in pairs."""
    like = np.empty(0, np.uint16)
    I2 = at.shape[1]
    I = 2 * I2
    for t in prange(at.shape[0]):
        for k in range(I2):
            for lane in range(LANES):
                a = silu(h[2 * k, t, lane]) * h[I + 2 * k, t, lane]
                b = silu(h[2 * k + 1, t, lane]) * h[I + 2 * k + 1, t, lane]
                at[t, k, lane] = _pair(a, b, like)


@njit(**HOT)
def _combine(y, ptok, pw, offs, base, out):
    """out[T,H] += sum over pairs of pw * y[:, tile, lane]; columns split over threads."""
    H = out.shape[1]
    for h0 in prange((H + 63) // 64):
        for u in range(offs.shape[0] - 1):
            for j in range(offs[u + 1] - offs[u]):
                p = offs[u] + j
                t, lane = base[u] + j // LANES, j % LANES
                for h in range(h0 * 64, min(h0 * 64 + 64, H)):
                    out[ptok[p], h] += pw[p] * y[h, t, lane]


def runs_here(gu, dn) -> bool:
    """The tiles can read these banks (bf16 pairs, u32 views, rows a multiple of 4) on this CPU
    (AVX512-BF16)."""
    from freetoken.kernels._isa import bf16_dots
    usable = all(w.dtype == np.uint32 and w.shape[1] % 4 == 0 and w.flags.c_contiguous for w in (gu, dn))
    return usable and bf16_dots()


def gemm(x, gu, dn, uniq, offs, ptok, pw, out):
    """out f32[T,H] = each token's experts weighted and summed; gu u32[S,2I,H/2], dn u32[S,H,I/2]
    (bf16 pairs); the plan (uniq, offs, ptok, pw) as experts._plan makes it. Whole experts in
    passes of about PASS_PAIRS pairs."""
    x = np.ascontiguousarray(x, np.float32)
    out[...] = 0.0
    a = 0
    while a < uniq.shape[0]:
        b = a + 1
        while b < uniq.shape[0] and offs[b + 1] - offs[a] <= PASS_PAIRS:
            b += 1
        p0, p1 = offs[a], offs[b]
        _pass(x, gu, dn, uniq[a:b], offs[a:b + 1] - p0, ptok[p0:p1], pw[p0:p1], out)
        a = b
    return out


def _pass(x, gu, dn, uniq, offs, ptok, pw, out):
    base = _tiles(offs)
    nt = int(base[-1])
    xt = np.empty((nt, gu.shape[2], LANES), np.uint32)
    _pack_x(x, ptok, offs, base, xt)
    h = np.empty((gu.shape[1], nt, LANES), np.float32)                 # [2I,NT,16]
    _bank(gu, uniq, base, xt, h)
    del xt                                                             # peak: h and at, not all four
    at = np.empty((nt, dn.shape[2], LANES), np.uint32)
    _swiglu_pack(h, at)
    del h
    y = np.empty((dn.shape[1], nt, LANES), np.float32)                 # [H,NT,16]
    _bank(dn, uniq, base, at, y)
    _combine(y, ptok, pw, offs, base, out)
