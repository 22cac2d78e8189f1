"""Causal GQA attention over the token-slot KV pool; pairs: cuda/attention.cu,
tests/kernels/test_attention.py (sinks and windows: test_attention_sinks.py).

Token t of sequence s = tok_seq[t] at position p = tok_pos[t] attends to the cached rows at slots
slot_table[s, 0..p] (inclusive); query head h reads kv group h // (Hq // G). One layout covers
prefill, chunked prefill over a cached prefix, decode, and batches of sequences mixed in a step.

Keywords (gpt-oss): ``window`` W > 0 is a sliding window, position p reading only
slot_table[s, max(0, p-W+1)..p] (W positions; 0: the whole prefix). ``sinks`` f32[Hq], one finite
learned logit a head: it joins the softmax's denominator as exp(sinks[h] - m), m the max over the
scores and the sink, and its own weight is dropped (the weights sum to < 1; transformers' eager
gpt-oss). All three devices take both.

Non-finite inputs (cpu and gpu, on every path, follow ``ref``: numpy's exp(s - max) / sum for each
(token, head) over the token's context). A NaN score (a NaN in the head's q or in a key row the
token reads) or a +inf one (an inf key coordinate times a q coordinate of the same sign) makes
that (token, head)'s output NaN, all D of it. A -inf score among finite ones is weight 0: the key
drops out; a (token, head) whose every score is -inf is NaN (0 / 0), or 0 with a sink (0 / its
exp). An inf in a value row makes that coordinate of the output inf (same sign) for every (token,
head) that weighs the row above 0. Keys and values past a token's position or before its window,
other heads and other sequences never reach its output. Not pinned: an inf value where ref's
weight is exactly 0 (a -inf score, or an exp that underflows): ref gets 0 * inf = NaN, a kernel's
exp may keep a tiny weight there.
"""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._blas_pool import workers
from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import attention_decode, attention_tiles
from freetoken.kernels._numba import SERIAL, njit

TILED_MIN = 32   # query tokens of one sequence in a step from which tiled GEMMs beat the kernel


def ref(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out=None, *, sinks=None, window=0):
    """q f32[T,Hq,D], k_cache, v_cache [N,G,D], slot_table int32[B,C], tok_seq, tok_pos int32[T]
    -> f32[T,Hq,D]; scores = (q . k) * scale, softmax in fp32; sinks f32[Hq] or None, window W
    (module doc)."""
    T, Hq, D = q.shape
    rep = Hq // k_cache.shape[1]
    res = np.empty((T, Hq, D), np.float32)
    for t in range(T):
        first = max(0, tok_pos[t] - window + 1) if window > 0 else 0
        slots = slot_table[tok_seq[t], first:tok_pos[t] + 1]
        k = to_f32(k_cache[slots])                               # [n,G,D]
        v = to_f32(v_cache[slots])
        for h in range(Hq):
            s = (k[:, h // rep] @ q[t, h].astype(np.float32)) * np.float32(scale)   # [n]
            sink = np.float32(-np.inf if sinks is None else sinks[h])   # none: adds exactly 0 below
            top = np.maximum(s.max(), sink)                                # NaN stays NaN
            p = np.exp(s - top)
            res[t, h] = (p / (p.sum() + np.exp(sink - top))) @ v[:, h // rep]
    if out is None:
        return res
    out[...] = res
    return out


def _check(q, k_cache, slot_table, tok_seq, tok_pos, window=0):
    """The kernel does not bounds-check: validate every slot it will read, once per sequence
    (in numba: a decode step's numpy calls here cost more than its attention at short context)."""
    T, Hq, D = q.shape
    N, G, _ = k_cache.shape
    assert k_cache.shape[2] == D and Hq % G == 0, (q.shape, k_cache.shape)
    if T == 0:
        return
    bad = _first_bad_sequence(np.ascontiguousarray(slot_table, np.int32), np.ascontiguousarray(tok_seq, np.int32),
                              np.ascontiguousarray(tok_pos, np.int32), N, *((window,) if window else ()))
    if bad == -2:
        raise IndexError("attention: tok_seq or tok_pos outside slot_table")
    if bad >= 0:
        raise IndexError(f"attention: sequence {bad} reads a slot outside [0, {N})")


@njit(**SERIAL)
def _first_bad_sequence(slot_table, tok_seq, tok_pos, n_slots, window=0):
    """-1 when every slot the tokens read (slot_table[s, first..last] of s's positions, first
    the earliest window start, 0 without a window) is in [0, n_slots); else the first sequence
    that reads one outside, or -2 for a token whose sequence or position is outside slot_table.
    Without a window (decode_layer's call too) numba compiles the code it did before windows."""
    B, C = slot_table.shape
    first, last = np.full(B, C, np.int64), np.full(B, -1, np.int64)
    for t in range(tok_seq.shape[0]):
        s, p = tok_seq[t], tok_pos[t]
        if s < 0 or s >= B or p < 0 or p >= C:
            return -2
        last[s] = max(last[s], p)
        first[s] = min(first[s], max(0, p - window + 1) if window > 0 else 0)
    for s in range(B):
        for j in range(first[s], last[s] + 1):
            if slot_table[s, j] < 0 or slot_table[s, j] >= n_slots:
                return s
    return -1


def _by_path(tok_seq):
    """Step tokens of sequences with >= TILED_MIN of them (prefill) and the rest (decode)."""
    if tok_seq.shape[0] < TILED_MIN:           # no sequence can have that many: all decode
        return _NO_TOKENS, np.arange(tok_seq.shape[0])
    counts = np.bincount(tok_seq)
    tiled = counts[tok_seq] >= TILED_MIN
    return np.flatnonzero(tiled), np.flatnonzero(~tiled)


_NO_TOKENS = np.empty(0, np.int64)


def cpu(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out=None, *, sinks=None, window=0):
    """Same contract as ``ref``: tiled GEMMs (attention_tiles) for the tokens of a sequence
    with many in the step, the split-K decode kernel (attention_decode) for the rest."""
    q = np.ascontiguousarray(q, np.float32)
    slot_table = np.ascontiguousarray(slot_table, np.int32)
    tok_seq = np.ascontiguousarray(tok_seq, np.int32)
    tok_pos = np.ascontiguousarray(tok_pos, np.int32)
    assert int(window) >= 0 and (sinks is None or np.shape(sinks) == q.shape[1:2]), (window, np.shape(sinks))
    sinks, window = None if sinks is None else np.ascontiguousarray(sinks, np.float32), int(window)
    _check(q, k_cache, slot_table, tok_seq, tok_pos, window)
    if out is None:
        out = np.empty(q.shape, np.float32)
    if q.shape[0] == 0:
        return out
    tiled, rest = _by_path(tok_seq)
    if tiled.size:
        attention_tiles.prefill(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out,
                                tiled, sinks, window)
    if rest.size == q.shape[0]:
        _decode_kernel(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, sinks, window)
    elif rest.size:
        part = np.empty((rest.size,) + q.shape[1:], np.float32)
        _decode_kernel(q[rest], k_cache, v_cache, slot_table, tok_seq[rest], tok_pos[rest], scale,
                       part, sinks, window)
        out[rest] = part
    return out


def _decode_kernel(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, sinks, window):
    assert k_cache.dtype == v_cache.dtype, "k and v caches must share a dtype"
    attention_decode.run(q, np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache), slot_table,
                         tok_seq, tok_pos, scale, out, workers(), sinks, window)


# --- gpu (cuda/attention.cu) --------------------------------------------------------------------

THREADS = 128            # ATT_THREADS in attention.cu
TARGET_BLOCKS = 264      # decode split-K: about two blocks per SM of a 132-SM H100/H200
MAX_CHUNK = 256          # most positions per decode chunk: a graph's table is padded to the
                         # context cap, so chunks must stay short for short real contexts
SMEM_FLOATS = 12 * 1024  # 48 KiB, the dynamic shared memory a launch gets without an opt-in


def _inputs(w):
    return ("q:f32*", f"k_cache:{w}", f"v_cache:{w}", "slot_table:i32*", "tok_seq:i32*",
            "tok_pos:i32*", "scale:f32")


ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    **{f"attention_decode_{tag}": (*_inputs(w), "part_o:f32*", "part_ml:f32*", "Hq:i32", "G:i32",
                                   "D:i32", "C:i32", "CH:i32", "nch:i32", "window:i32")
       for tag, w in (("bf16", "u16*"), ("f32", "f32*"))},
    **{f"attention_prefill_{tag}": (*_inputs(w), "sinks:f32*", "out:f32*", "T:i32", "Hq:i32",
                                    "G:i32", "D:i32", "C:i32", "window:i32", "use_sinks:i32")
       for tag, w in (("bf16", "u16*"), ("f32", "f32*"))},
    "attention_decode_reduce_f32": ("part_o:f32*", "part_ml:f32*", "tok_pos:i32*", "sinks:f32*",
                                    "out:f32*", "Hq:i32", "D:i32", "CH:i32", "nch:i32",
                                    "window:i32", "use_sinks:i32"),
}
_SCRATCH: dict = {}  # device id -> grow-only list of byte buffers (see _scratch)


def _scratch(like, nbytes: int):
    """Device bytes for one call's temporaries. Grow-only and never freed: a CUDA graph keeps
    the address it captured, and calls on one stream never overlap, so all calls share the newest
    buffer; power-of-two sizes keep the total under twice the largest. A numpy ``like`` gets
    host bytes (the wrapper dry runs of the tests)."""
    if isinstance(like, np.ndarray):
        return np.empty(nbytes, np.uint8)
    cupy = load_cupy()
    bufs = _SCRATCH.setdefault(cupy.cuda.Device().id, [])
    if not bufs or bufs[-1].nbytes < nbytes:
        bufs.append(cupy.empty(1 << max(nbytes - 1, 0).bit_length(), cupy.uint8))
    return bufs[-1]


def _align(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def scratch_bytes(T: int, Hq: int, D: int, nch: int) -> int:
    """Bytes of decode partials for T tokens split into nch chunks (see _decode)."""
    return _align(4 * T * Hq * nch * D) + _align(8 * T * Hq * nch)


def _decode_chunk(T, G, C, rep, D):
    """Positions per split-K chunk: enough chunks for TARGET_BLOCKS blocks, a multiple of 32,
    and small enough that the group's queries, scores and slots fit in shared memory."""
    most = min(MAX_CHUNK, (SMEM_FLOATS - rep * D) // (rep + 1) // 32 * 32)
    assert most >= 32, f"attention: {rep} heads per kv group x D {D} overflow the decode kernel"
    per = -(-C // -(-TARGET_BLOCKS // (T * G)))            # C / wanted chunks, rounded up
    return max(32, min(most, -(-per // 32) * 32))


def _decode(_cuda, tag, q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, sinks,
            window):
    T, Hq, D = q.shape
    G, C = k_cache.shape[1], slot_table.shape[1]
    rep = Hq // G
    span = min(C, window) if window else C     # positions a token can read: chunks cover these
    CH = _decode_chunk(T, G, span, rep, D)
    nch = -(-span // CH)
    buf = _scratch(q, scratch_bytes(T, Hq, D, nch))
    at = _align(4 * T * Hq * nch * D)
    part_o = buf[:4 * T * Hq * nch * D].view(np.float32)               # [T,Hq,nch,D]
    part_ml = buf[at:at + 8 * T * Hq * nch].view(np.float32)           # [T,Hq,nch,2]
    entry = f"attention_decode_{tag}"
    args = _cuda.bind(ARGS[entry], q=q, k_cache=k_cache, v_cache=v_cache, slot_table=slot_table,
                      tok_seq=tok_seq, tok_pos=tok_pos, scale=scale, part_o=part_o,
                      part_ml=part_ml, Hq=Hq, G=G, D=D, C=C, CH=CH, nch=nch, window=window)
    _cuda.launch(_cuda.kernel("attention", entry), (nch, G, T), (THREADS,), args,
                 shared_mem=4 * (rep * D + rep * CH + CH))
    entry = "attention_decode_reduce_f32"
    args = _cuda.bind(ARGS[entry], part_o=part_o, part_ml=part_ml, tok_pos=tok_pos,
                      sinks=_sinks_arg(q, sinks), out=out, Hq=Hq, D=D, CH=CH, nch=nch,
                      window=window, use_sinks=int(sinks is not None))
    _cuda.launch(_cuda.kernel("attention", entry), (Hq, T), (THREADS,), args)


def _sinks_arg(q, sinks):
    """The kernels' sinks pointer: any device array when there are none (use_sinks 0: never read)."""
    return q if sinks is None else sinks


def _prefill(_cuda, tag, q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, sinks,
             window):
    T, Hq, D = q.shape
    G, C = k_cache.shape[1], slot_table.shape[1]
    BQ = 8 if D > 128 else 16  # query tokens per block: 4 warps x RPW rows in prefill_impl
    entry = f"attention_prefill_{tag}"
    args = _cuda.bind(ARGS[entry], q=q, k_cache=k_cache, v_cache=v_cache, slot_table=slot_table,
                      tok_seq=tok_seq, tok_pos=tok_pos, scale=scale,
                      sinks=_sinks_arg(q, sinks), out=out, T=T, Hq=Hq, G=G, D=D, C=C,
                      window=window, use_sinks=int(sinks is not None))
    _cuda.launch(_cuda.kernel("attention", entry), (-(-T // BQ), Hq), (THREADS,), args,
                 shared_mem=4 * D * (33 + BQ))   # K tile [D][33] + queries [BQ][D]


def gpu(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, out, *, sinks=None, window=0):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,Hq,D] is required. One token per
    sequence (T == B, as every scheduled row has >= 1 token): split-K decode kernel + reduce;
    otherwise the prefill kernel. Both are correct for any layout: the choice is speed only.
    No host synchronisation (capture-safe), so slots are checked only under FREETOKEN_KERNEL_DEBUG.
    Without sinks the kernels get q's pointer in their place, unread (use_sinks 0)."""
    from freetoken.env import flag
    from freetoken.kernels import _cuda
    T, Hq, D = q.shape
    N, G, _ = k_cache.shape
    B, C = slot_table.shape
    assert k_cache.shape == v_cache.shape == (N, G, D) and k_cache.dtype == v_cache.dtype, \
        (q.shape, k_cache.shape, v_cache.shape, v_cache.dtype)
    assert Hq % G == 0 and 0 < D <= 256 and C > 0, (q.shape, k_cache.shape, slot_table.shape)
    assert out.shape == (T, Hq, D) and tok_seq.shape == tok_pos.shape == (T,), \
        (out.shape, tok_seq.shape, tok_pos.shape)
    assert int(window) >= 0 and (sinks is None or (sinks.shape == (Hq,) and sinks.dtype == np.float32)), \
        (window, getattr(sinks, "shape", None))
    if T == 0:
        return out
    if flag("KERNEL_DEBUG"):   # synchronises: never inside a graph capture
        _check(q, k_cache, *(a.get() if hasattr(a, "get") else a
                             for a in (slot_table, tok_seq, tok_pos)), int(window))
    run = _decode if T == B else _prefill
    run(_cuda, _cuda.dtype_tag(k_cache), q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale,
        out, sinks, int(window))
    return out
