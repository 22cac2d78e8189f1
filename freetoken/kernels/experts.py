"""Routed SwiGLU experts; pairs: cuda/experts.cu, tests/kernels/test_experts.py,
bench/kernels/experts_cpu.py.

out[t] = sum_j weights[t,j] * down[e] @ (silu(g) * u) with g, u = split(gate_up[e] @ x[t]) and
e = ids[t,j]; ids < 0 contribute nothing, duplicate ids in a row both count, and ``out`` is
overwritten.

bias=(gate_up_bias f32[S,2I], down_bias f32[S,H]) adds row e to gate_up[e] @ x and to down[e] @ act
(so the down bias is weighted by weights[t,j], as in transformers); glu=(alpha, limit) replaces
silu(g) * u with gpt-oss's clamped SwiGLU, (u' + 1) * g' * sigmoid(alpha * g') with g' = min(g, limit),
u' = clip(u, -limit, limit) (experts_glu.py); both keyword-only, None by default (the op above).
"""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._blas_pool import run_items
from freetoken.kernels._activations import silu_mul
from freetoken.kernels._numba import HOT, SERIAL, dots, njit, prange, split_x, weight_rows
from freetoken.kernels import experts_bf16, experts_glu
from freetoken.kernels.experts_bf16 import bf16_rounding, rounded_bf16, wants_bf16
from freetoken.kernels.experts_quant import _combine   # shared with the quantized decode, which runs it in its own call
from freetoken.kernels.experts_pairs import _pairs_gemv
from freetoken.kernels.linear import widen_rows
from freetoken.kernels.qact import rounded, rounded_ref, wants_int8
from freetoken.kernels.qformats import dequantize_ref, is_quantized, logical_shape

ROWS = 32            # rows per parallel work item: amortises per-item costs, >= 8 items per thread
BLAS_MIN_PAIRS = 32  # from this many tokens per expert (mean), widen experts once and use BLAS


def _silu(g):
    with np.errstate(over="ignore"):
        return g / (np.float32(1.0) + np.exp(-g))


def _swiglu(h, I, glu):
    """silu(g) * u of h's halves g = h[:I], u = h[I:], or glu=(alpha, limit)'s clamped SwiGLU."""
    return _silu(h[:I]) * h[I:] if glu is None else experts_glu.clamped_swiglu(h[:I], h[I:], *glu)


def _expert_f32(w, e):
    """Expert e's weights in fp32: bf16 widened, or quantized blocks dequantized as gguf-py does
    (kernels/qblocks.py: the spec of every quantized kernel)."""
    return dequantize_ref(w[e]) if is_quantized(w) else to_f32(w[e])


def ref(x, ids, weights, gate_up, down, out=None, *, dots="f32", bf16=False, bias=None, glu=None):
    """x f32[T,H], ids int32[T,k], weights f32[T,k], gate_up [S,2I,H], down [S,H,I] -> f32[T,H]
    (quantized banks: [S,2I,H/V,B], [S,H,I/V,B], kernels/qblocks.py). dots="int8": x and the
    activation rounded as the int8 dots round them (kernels/qact.py) before a bank whose format
    has them; bf16=True: rounded to bf16 before a bf16 bank (experts_bf16.wants_bf16). bias, glu:
    the module doc; the activation is rounded after the glu, as after silu(g) * u."""
    T, H = x.shape
    S, _, I = logical_shape(down)
    bias = experts_glu.biases(bias, S, I, H)
    x = np.asarray(x, np.float32)
    x = rounded_ref(x) if wants_int8(gate_up, dots) else rounded_bf16(x) if wants_bf16(gate_up, bf16) else x
    act_rounding = rounded_ref if wants_int8(down, dots) else bf16_rounding(down, bf16)
    res = np.zeros((T, H), np.float32)
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = _expert_f32(gate_up, e) @ x[t]                 # [2I]
            h = h if bias is None else h + bias[0][e]
            act = act_rounding(_swiglu(h, I, glu)[None])[0]    # [I], fp32 (or int8-rounded)
            y = _expert_f32(down, e) @ act
            res[t] += np.float32(weights[t, j]) * (y if bias is None else y + bias[1][e])
    if out is None:
        return res
    out[...] = res
    return out


@njit(**SERIAL)
def _plan(ids, weights, n_slots):
    """Group (token, expert) pairs by expert, ascending id; a duplicate id in a row is merged
    into its first occurrence (weights summed) so a token appears once per expert group.
    Returns uniq int32[U], offs int32[U+1], ptok int32[P], pw f32[P]. Plain loops only: they
    compile in a fraction of the time numpy calls inside numba take."""
    T, K = ids.shape
    first = np.zeros((T, K), np.bool_)
    start = np.zeros(n_slots + 1, np.int32)                     # counts, then group starts
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if e >= n_slots:
                raise IndexError("experts: expert id out of range")
            dup = False
            for jj in range(j):
                dup = dup or ids[t, jj] == e
            if e >= 0 and not dup:
                first[t, j] = True
                start[e + 1] += 1
    U = 0
    for e in range(n_slots):
        U += start[e + 1] > 0
        start[e + 1] += start[e]
    uniq = np.empty(U, np.int32)
    offs = np.empty(U + 1, np.int32)
    offs[U] = start[n_slots]
    U = 0
    for e in range(n_slots):
        if start[e + 1] > start[e]:
            uniq[U], offs[U] = e, start[e]
            U += 1
    ptok = np.empty(start[n_slots], np.int32)
    pw = np.zeros(start[n_slots], np.float32)
    for t in range(T):
        for j in range(K):
            if first[t, j]:
                e = ids[t, j]
                ptok[start[e]] = t
                for jj in range(j, K):
                    pw[start[e]] += weights[t, jj] if ids[t, jj] == e else np.float32(0.0)
                start[e] += 1
    return uniq, offs, ptok, pw


@njit(**HOT)
def _gate_up(xs, gate_up, uniq, offs, ptok, act):
    """act[p] = silu(g) * u for every pair p; xs f32[T,L,H/L], act f32[P,Ld,I/Ld] (layouts of
    _numba). Work items are (expert, block of ROWS rows) in weight order, so each thread's
    static share of the items is one long sequential stream, the prefetcher's best case."""
    I = gate_up.shape[1] // 2
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
                act[offs[u] + j, i % Ld, i // Ld] = silu_mul(g[j], v[j])


@njit(**HOT)
def _down(act, down, uniq, offs, iota, y):
    """y[h, p] = down[e_p, h] . act[p]; items as in _gate_up; iota int32[>=P] = 0, 1, 2, ..."""
    H = y.shape[0]
    nhb = (H + ROWS - 1) // ROWS
    for item in prange(uniq.shape[0] * nhb):
        u, h0 = item // nhb, (item % nhb) * ROWS
        pairs = act[offs[u]:offs[u + 1]]
        rows = iota[:pairs.shape[0]]
        for h in range(h0, min(h0 + ROWS, H)):
            dots(pairs, rows, down[uniq[u], h], y[h, offs[u]:])


def _gemv(x, gate_up, down, uniq, offs, ptok, pw, out, bf16=False):
    """Few tokens (decode): every weight row is read once per call, by the numba row dots; x and
    the silu's output rounded to bf16 first under bf16."""
    gu, dn = weight_rows(gate_up), weight_rows(down)
    if gu.dtype == np.uint32 and dn.dtype == np.uint32:
        return _pairs_gemv(x, gu, dn, bf16, uniq, offs, ptok, pw, out)
    x = rounded_bf16(x) if bf16 else x
    Ld = 2 if dn.dtype == np.uint32 else 1
    P = ptok.shape[0]
    act = np.empty((P, Ld, down.shape[2] // Ld), np.float32)     # [P,Ld,I/Ld]
    y = np.empty((out.shape[1], P), np.float32)                   # [H,P]
    _gate_up(split_x(x, gu), gu, uniq, offs, ptok, act)
    if bf16:
        act[...] = rounded_bf16(act)
    _down(act, dn, uniq, offs, np.arange(P, dtype=np.int32), y)
    _combine(y, ptok, pw, out)
    return out


def _blas(x, gate_up, down, uniq, offs, ptok, pw, out, dots, bf16=False, bias=None, glu=None):
    """Prefill path: one expert per pool thread, start to end: widen its weights into the
    thread's fp32 buffers, two single-threaded GEMMs, the weighted rows added into the thread's
    own sum (no two threads write one array); the sums are added at the end. Biggest groups
    first, so the last items are short."""
    I = logical_shape(down)[2]
    x = rounded(x) if wants_int8(gate_up, dots) else x
    act_rounding = (lambda a: rounded(a.T, parallel=False).T) if wants_int8(down, dots) else bf16_rounding(down, bf16)

    def scratch():
        return (np.zeros(out.shape, np.float32), np.empty(logical_shape(gate_up)[1:], np.float32),
                np.empty(logical_shape(down)[1:], np.float32))    # sum [T,H], [2I,H], [H,I]

    def one_expert(u, st):
        # weights on the left: OpenBLAS runs [M,K]@[K,n] 25% faster than [n,K]@[K,M] for the
        # n = 32-128 tokens an expert gets (one thread, H 1024, 2-core Xeon: 105 vs 84 GFLOP/s)
        acc, wgu, wd = st
        tok = ptok[offs[u]:offs[u + 1]]
        h = _as_f32(gate_up[uniq[u]], wgu) @ x[tok].T             # [2I,n]
        if bias is not None:
            h += bias[0][uniq[u], :, None]
        act = act_rounding(_swiglu(h, I, glu))                    # [I,n]
        y = _as_f32(down[uniq[u]], wd) @ act                      # [H,n]
        if bias is not None:
            y += bias[1][uniq[u], :, None]
        acc[tok] += y.T * pw[offs[u]:offs[u + 1], None]

    order = np.argsort(-np.diff(offs), kind="stable")
    sums = [st[0] for st in run_items(order.tolist(), one_expert, scratch)]
    np.copyto(out, sums[0])
    for more in sums[1:]:             # in place: np.sum over the list would stack a [n,T,H] copy
        out += more
    return out


def _as_f32(w, buf):
    if w.dtype == np.float32:
        return w
    if w.ndim == 3:                   # one expert's quantized rows [R, H/V, B]
        from freetoken.kernels.linear_quant import dequant_rows
        return dequant_rows(w, buf)
    return widen_rows(w, buf)


def cpu(x, ids, weights, gate_up, down, out=None, *, dots="f32", bf16=False, bias=None, glu=None):
    """Same contract as ``ref``; numba GEMVs for few tokens per expert, BLAS for many. With bias or
    glu the general paths run (experts_glu.gemv, _blas) and the int8 tile GEMM (experts_glu.tile_gemm)."""
    x = np.ascontiguousarray(x, np.float32)
    T, H = x.shape
    (S, two_i, Hg), (_, Hd, I) = logical_shape(gate_up), logical_shape(down)
    assert Hg == H and Hd == H and two_i == 2 * I and gate_up.dtype == down.dtype
    quantized = is_quantized(gate_up)
    assert quantized or (gate_up.flags.c_contiguous and down.flags.c_contiguous)
    if out is None:
        out = np.empty((T, H), np.float32)
    bias, plain = experts_glu.biases(bias, S, I, H), bias is None and glu is None
    plan = _plan(np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(weights, np.float32), S)
    if quantized:
        from freetoken.kernels import experts_quant as quant
        if quant.uses_gemm(gate_up, down, dots, plan):
            if plain:
                return quant.gemm(x, gate_up, down, *plan, out)
            return experts_glu.tile_gemm(x, gate_up, down, plan, out, bias, glu)
    bf16 = wants_bf16(gate_up, bf16)
    many = plan[2].shape[0] >= BLAS_MIN_PAIRS * max(1, plan[0].shape[0])
    if many and plain and bf16 and experts_bf16.runs_here(weight_rows(gate_up), weight_rows(down)):
        # the tiles round x as they pack it (the same rounding): not twice
        return experts_bf16.gemm(x, weight_rows(gate_up), weight_rows(down), *plan, out)
    if many:
        return _blas(rounded_bf16(x) if bf16 else x, gate_up, down, *plan, out, dots, bf16, bias, glu)
    if not plain:
        return experts_glu.gemv(x, gate_up, down, plan, out, dots, bf16, bias, glu, _down)
    if quantized:
        return quant.gemv(x, gate_up, down, *plan, out, dots)
    return _gemv(x, gate_up, down, *plan, out, bf16)     # rounds x itself under bf16


# --- gpu (cuda/experts.cu) ----------------------------------------------------------------------

GEMV_MAX_T = 16         # up to here a GEMV per routed pair (shared experts re-read from L2); above,
                        # pairs are sorted by expert so each expert's weights stream once per tile
TILE = 64               # TILE_T in cuda/gemv_common.cuh: pair rows of one GEMM tile
PLAN_THREADS = 1024     # experts_plan_i32 is one block of this many threads
MAX_TILE_BLOCKS = 1024  # GEMM grid.x: a block-strided loop covers the remaining tiles
_W = (("bf16", "u16*"), ("f32", "f32*"))
_PLAN = ("perm:i32*", "offs:i32*", "tile_expert:i32*", "tile_row:i32*", "n_tiles:i32*")
_GU = ("gu_bias:f32*", "alpha:f32", "limit:f32", "use_bias:i32", "clamped:i32")  # bias=, glu=
_DN = ("dn_bias:f32*", "use_bias:i32")
ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    **{f"experts_gate_up_{t}": ("x:f32*", "ids:i32*", f"gate_up:{w}", "act:f32*", "k:i32",
                                "H:i32", "I:i32", "S:i32", *_GU) for t, w in _W},
    **{f"experts_down_{t}": ("ids:i32*", "weights:f32*", f"down:{w}", "act:f32*", "out:f32*",
                             "k:i32", "H:i32", "I:i32", "S:i32", *_DN) for t, w in _W},
    **{f"experts_gemm_gate_up_{t}": ("x:f32*", f"gate_up:{w}", *_PLAN, "act:f32*", "k:i32",
                                     "H:i32", "I:i32", *_GU) for t, w in _W},
    **{f"experts_gemm_down_{t}": ("act:f32*", f"down:{w}", *_PLAN, "y:f32*", "H:i32", "I:i32",
                                  *_DN) for t, w in _W},
    "experts_plan_i32": ("ids:i32*", "P:i32", "S:i32", "offs:i32*", "cursor:i32*", "perm:i32*",
                         "tile_expert:i32*", "tile_row:i32*", "n_tiles:i32*"),
    "experts_combine_f32": ("ids:i32*", "weights:f32*", "y:f32*", "out:f32*", "k:i32", "H:i32",
                            "S:i32"),
    # cuda/experts_quant.cu: quantized banks, one module per format, slots a stride apart
    "experts_gate_up_q": ("x:f32*", "ids:i32*", "gate_up:u8*", "gu_stride:i64", "act:f32*",
                          "k:i32", "H:i32", "I:i32", "S:i32", *_GU),
    "experts_down_q": ("ids:i32*", "weights:f32*", "down:u8*", "dn_stride:i64", "act:f32*",
                       "out:f32*", "k:i32", "H:i32", "I:i32", "S:i32", *_DN),
    "experts_gemm_gate_up_q": ("x:f32*", "gate_up:u8*", "gu_stride:i64", *_PLAN, "act:f32*",
                               "k:i32", "H:i32", "I:i32", *_GU),
    "experts_gemm_down_q": ("act:f32*", "down:u8*", "dn_stride:i64", *_PLAN, "y:f32*", "H:i32",
                            "I:i32", *_DN),
}


def _layout(T, k, H, I, S):
    """(name, dtype, count) of the device scratch for T tokens: decode needs act per pair;
    prefill also the plan (sorted pairs, tile table) and each pair's down output y."""
    P = T * k
    if T <= GEMV_MAX_T:
        return (("act", np.float32, P * I),)
    tiles = -(-P // TILE) + min(S, P)  # each non-empty group adds at most one partial tile
    return (("offs", np.int32, S + 1), ("cursor", np.int32, S), ("perm", np.int32, P),
            ("tile_expert", np.int32, tiles), ("tile_row", np.int32, tiles),
            ("n_tiles", np.int32, 1), ("act", np.float32, P * I), ("y", np.float32, P * H))


def scratch_bytes(T: int, k: int, H: int, I: int, S: int) -> int:
    from freetoken.kernels.attention import _align
    return sum(_align(4 * n) for _, _, n in _layout(T, k, H, I, S))


def _carve(like, layout) -> dict:
    # one shared grow-only scratch pool for all ops (attention._scratch; it belongs in _cuda.py)
    from freetoken.kernels.attention import _align, _scratch
    buf, views, at = _scratch(like, sum(_align(4 * n) for _, _, n in layout)), {}, 0
    for name, dtype, n in layout:
        views[name] = buf[at:at + 4 * n].view(dtype)
        at += _align(4 * n)
    return views


class _Banks:
    """The kernel of each launch for this pair of banks: experts.cu's *_bf16 / *_f32 entries, or
    experts_quant.cu's *_q built for the bank's format (gate_up and down may differ: Q4_K_M keeps
    some layers' down in Q6_K), with the slot stride it reads quantized slots at."""

    def __init__(self, _cuda, gate_up, down, glu_args):
        self._cuda, self.quantized = _cuda, is_quantized(gate_up)
        self.tag = "q" if self.quantized else _cuda.dtype_tag(gate_up)
        if self.quantized:   # slot views may be strided in their first axis (pool.slot_views)
            self.banks = {"gate_up": _cuda.flat_span(gate_up), "down": _cuda.flat_span(down)}
            self.extra = {"gate_up": {"gu_stride": gate_up.strides[0]},
                          "down": {"dn_stride": down.strides[0]}}
            self.defines = {"gate_up": _cuda.quant_defines(gate_up), "down": _cuda.quant_defines(down)}
        else:
            self.banks, self.extra = {"gate_up": gate_up, "down": down}, {"gate_up": {}, "down": {}}
        for bank in ("gate_up", "down"):
            self.extra[bank].update(glu_args[bank])

    def launch(self, kind, bank, grid, block, **args):
        """Launch experts_<kind>_<tag> reading ``bank`` ("gate_up" or "down")."""
        _cuda, e = self._cuda, f"experts_{kind}_{self.tag}"
        kern = (_cuda.kernel("experts_quant", e, self.defines[bank]) if self.quantized
                else _cuda.kernel("experts", e))
        _cuda.launch(kern, grid, block, _cuda.bind(ARGS[e], **{bank: self.banks[bank]},
                                                   **self.extra[bank], **args))


def _decode(_cuda, banks, x, ids, weights, out, part, k, H, I, S):
    T = x.shape[0]
    banks.launch("gate_up", "gate_up", (-(-I // 4), T * k), (128,), x=x, ids=ids,
                 act=part["act"], k=k, H=H, I=I, S=S)
    banks.launch("down", "down", (-(-H // 4), T), (128,), ids=ids, weights=weights,
                 act=part["act"], out=out, k=k, H=H, I=I, S=S)


def _prefill(_cuda, banks, x, ids, weights, out, part, k, H, I, S):
    T = x.shape[0]
    plan = {name: part[name] for name in ("perm", "offs", "tile_expert", "tile_row", "n_tiles")}
    e = "experts_plan_i32"
    _cuda.launch(_cuda.kernel("experts", e), (1,), (PLAN_THREADS,), _cuda.bind(
        ARGS[e], ids=ids, P=T * k, S=S, cursor=part["cursor"], **plan))
    blocks = min(part["tile_row"].size, MAX_TILE_BLOCKS)
    banks.launch("gemm_gate_up", "gate_up", (blocks, -(-I // TILE)), (256,), x=x,
                 act=part["act"], k=k, H=H, I=I, **plan)
    banks.launch("gemm_down", "down", (blocks, -(-H // TILE)), (256,), act=part["act"],
                 y=part["y"], H=H, I=I, **plan)
    e = "experts_combine_f32"
    _cuda.launch(_cuda.kernel("experts", e), (-(-H // 128), T), (128,), _cuda.bind(
        ARGS[e], ids=ids, weights=weights, y=part["y"], out=out, k=k, H=H, S=S))


def gpu(x, ids, weights, gate_up, down, out, *, bias=None, glu=None):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,H] is required. T <= 16: grouped
    GEMV over the routed pairs; more: on-device counting sort by expert, then tiled GEMMs. Ids
    outside [0, S) are masked in-kernel (their scratch rows are never read). No host sync, so
    capture-safe; the one allocation is the shared grow-only scratch (scratch_bytes()).
    Quantized banks ([S,2I,H/V,B], [S,H,I/V,B]; each slot contiguous, the slots may be a stride
    apart) are read in their blocks (cuda/experts_quant.cu). bias (device f32 [S,2I] and [S,H])
    and glu=(alpha, limit) as in ``ref``."""
    from freetoken.env import flag
    from freetoken.kernels import _cuda
    T, H = x.shape
    (S, H_, I), k = logical_shape(down), ids.shape[1]
    assert logical_shape(gate_up) == (S, 2 * I, H) and H_ == H, (gate_up.shape, down.shape)
    assert gate_up.dtype == down.dtype, (gate_up.dtype, down.dtype)
    assert ids.shape == weights.shape == (T, k) and out.shape == (T, H), \
        (x.shape, ids.shape, weights.shape, out.shape)
    if T == 0:
        return out
    if flag("KERNEL_DEBUG") and int(ids.max()) >= S:   # synchronises: never inside a capture
        raise IndexError("experts: expert id out of range")
    part = _carve(x, _layout(T, k, H, I, S))
    run = _decode if T <= GEMV_MAX_T else _prefill
    run(_cuda, _Banks(_cuda, gate_up, down, _kernel_glu_args(x, bias, glu, S, I, H)), x, ids, weights,
        out, part, k, H, I, S)
    return out


def _kernel_glu_args(x, bias, glu, S, I, H) -> dict:
    """The kernels' bias= and glu= arguments per bank (cuda/experts_impl.cuh's Glu): without a
    bias its pointer is x's, unread (use_bias 0)."""
    if bias is not None:
        experts_glu.check_biases(*bias, S, I, H)
    gub, dnb = (x, x) if bias is None else bias
    alpha, limit = (0.0, 0.0) if glu is None else glu
    use = int(bias is not None)
    return {"gate_up": {"gu_bias": gub, "alpha": alpha, "limit": limit, "use_bias": use,
                        "clamped": int(glu is not None)},
            "down": {"dn_bias": dnb, "use_bias": use}}
