"""Token sampling from logits with temperature, top-k, top-p and min-p; pairs: cuda/sampling.cu,
tests/kernels/test_sampling.py.

Per row: temperature <= 0 -> argmax (ties -> lowest id). Otherwise p = softmax(logits * (1/T));
order tokens by p descending (ties -> lower id); keep the first top_k (<= 0: all) and
renormalise them; keep the shortest prefix whose mass reaches top_p (token i stays while the mass
before it is < top_p; top_p <= 0 or >= 1: all); drop p < min_p * p_max; drop p == 0; renormalise;
return the first token whose cumulative probability exceeds the row's uniform u in [0, 1).

Non-finite rows (every implementation follows ``ref``): greedy reads a NaN logit as -inf. A
sampled row whose scaled logits hold a NaN or +inf, or are all -inf, has no distribution to draw
from (the softmax is NaN): it takes its greedy token, so the id is always in [0, V).

Optional ``mask`` int32[B, ceil(V/32)] (constrained decoding): bit ``t & 31`` of word ``t >> 5``
set means token t is allowed. Disallowed tokens get logit -inf before everything above, so greedy
is the masked argmax and sampling draws from the masked distribution. A row of all -1 words is
unconstrained. Every masked row must allow at least one token (the grammar's stop token at least).
"""
import numpy as np
from numba import njit

FIRST_PREFIX = 64  # cpu: sorted candidates tried first; typical LLM rows decide within these


def _greedy(z):
    """argmax with NaN read as -inf, ties to the lowest id."""
    z = np.asarray(z, np.float32)
    return int(np.argmax(np.where(np.isnan(z), np.float32(-np.inf), z)))


def _no_distribution(z, temperature) -> bool:
    """Whether the scaled logits give no softmax: a NaN or +inf among them, or all -inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.asarray(z, np.float32) * (np.float32(1.0) / np.float32(temperature))
    return bool(np.isnan(s).any() or not np.isfinite(s.max()))


def _probs(z, temperature):
    z = np.asarray(z, np.float32) * (np.float32(1.0) / np.float32(temperature))
    p = np.exp(z - z.max())
    return p / p.sum()


def _pick(q, u):
    """Inverse CDF over kept probabilities q (descending): index of the first cumsum > u."""
    c = np.cumsum(q / q.sum())
    return min(int(np.searchsorted(c, np.float32(u), side="right")), q.shape[0] - 1)


def _ref_row(z, temperature, top_k, top_p, min_p, u):
    if temperature <= 0 or _no_distribution(z, temperature):
        return _greedy(z)
    p = _probs(z, temperature)
    order = np.argsort(-p, kind="stable")
    q = p[order]
    if 0 < top_k < q.shape[0]:
        q = q[:top_k] / q[:top_k].sum()
    if 0 < top_p < 1:
        before = np.concatenate(([np.float32(0.0)], np.cumsum(q)[:-1]))
        q = q[:np.count_nonzero(before < np.float32(top_p))]
    if min_p > 0:
        q = q[:np.count_nonzero(q >= np.float32(min_p) * q[0])]
    q = q[:np.count_nonzero(q > 0)]
    return int(order[_pick(q, u)])


def allowed_ref(mask, V):
    """bool[B, V] from the bitmask int32[B, ceil(V/32)] (little-endian bit order)."""
    m = np.ascontiguousarray(mask, dtype="<i4")
    return np.unpackbits(m.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)


def ref(logits, temperature, top_k, top_p, min_p, uniforms, out=None, *, mask=None):
    """logits f32[B,V], temperature f32[B], top_k int32[B], top_p f32[B], min_p f32[B],
    uniforms f32[B] (, mask int32[B, ceil(V/32)] or None) -> int32[B]."""
    B = logits.shape[0]
    if mask is not None:
        logits = np.where(allowed_ref(mask, logits.shape[1]), logits, np.float32(-np.inf)).astype(np.float32)
    out = np.empty(B, np.int32) if out is None else out
    for b in range(B):
        out[b] = _ref_row(logits[b], temperature[b], top_k[b], top_p[b], min_p[b], uniforms[b])
    return out


def _sorted_prefix(p, m):
    """Ids of the m most probable tokens plus every token tied with the m-th, in the global
    (p descending, id ascending) order: exactly the first len(result) ids of that order."""
    if m >= p.shape[0]:
        return np.argsort(-p, kind="stable")
    thr = np.partition(p, p.shape[0] - m)[p.shape[0] - m]
    cand = np.flatnonzero(p >= thr)
    return cand[np.argsort(-p[cand], kind="stable")]


@njit(cache=True, nogil=True)    # no fastmath (kernels/_numba's SERIAL): it may assume NaN away
def _argmax(z):
    """_greedy in one pass and no temporaries: the first maximum, a NaN never taken (so a row of
    NaN and -inf gives 0, as NaN read as -inf does). Why: _greedy's three passes over 8k logits
    were ~35 us of a decode step (Q4_0 medium, Zen 4 VM), cold-cache numpy after the layers."""
    best, at = -np.inf, 0
    for i in range(z.shape[0]):
        if z[i] > best:
            best, at = z[i], i
    return at


def _cpu_row(z, temperature, top_k, top_p, min_p, u):
    """``_ref_row`` without sorting the vocabulary: filter a sorted prefix of the order, and
    double it until the kept set ends inside it (or, with no filter, the CDF passes u)."""
    if temperature <= 0 or _no_distribution(z, temperature):
        return int(_argmax(np.asarray(z, np.float32)))
    p = _probs(z, temperature)
    V = p.shape[0]
    m = max(FIRST_PREFIX, top_k if 0 < top_k < V else 0)
    while True:
        cand = _sorted_prefix(p, m)
        q = p[cand]
        ended = cand.shape[0] == V                        # the prefix is the whole order
        if 0 < top_k < V:
            q, ended = q[:top_k] / q[:top_k].sum(), True
        if 0 < top_p < 1:
            before = np.concatenate(([np.float32(0.0)], np.cumsum(q)[:-1]))
            n = np.count_nonzero(before < np.float32(top_p))
            q, ended = q[:n], ended or n < q.shape[0]
        if min_p > 0:
            n = np.count_nonzero(q >= np.float32(min_p) * q[0])
            q, ended = q[:n], ended or n < q.shape[0]
        n = np.count_nonzero(q > 0)
        q, ended = q[:n], ended or n < q.shape[0]
        if ended:
            return int(cand[_pick(q, u)])
        if not (0 < top_p < 1 or min_p > 0):              # unfiltered: every token is kept
            c = np.cumsum(q / p.sum())
            i = int(np.searchsorted(c, np.float32(u), side="right"))
            if i < q.shape[0]:
                return int(cand[i])
        m *= 4


@njit(cache=True, nogil=True)
def _allowed_ids(words, V, ids):
    """Write the allowed token ids of one mask row into ids (ascending), word at a time (all-ones
    words are copied as a run, all-zero words skipped); returns how many."""
    n = 0
    for w in range(words.shape[0]):
        word = words[w]
        if word == 0:
            continue
        base = w * 32
        top = min(32, V - base)
        if word == -1:
            for j in range(top):
                ids[n + j] = base + j
            n += top
            continue
        for j in range(top):
            if (word >> j) & 1:
                ids[n] = base + j
                n += 1
    return n


def cpu(logits, temperature, top_k, top_p, min_p, uniforms, out=None, *, mask=None):
    """Same contract as ``ref``; avoids the full vocabulary sort (milliseconds at V = 150k). A
    masked row is sampled over its allowed tokens only (ascending ids, so the tie order holds)."""
    B, V = logits.shape
    out = np.empty(B, np.int32) if out is None else out
    ids = np.empty(V, np.int64) if mask is not None else None
    for b in range(B):
        z, keep = logits[b], None
        if mask is not None and not (mask[b] == -1).all():
            n = _allowed_ids(mask[b], V, ids)
            keep = ids[:n]
            z = z[keep]
        t = _cpu_row(z, temperature[b], top_k[b], top_p[b], min_p[b], uniforms[b])
        out[b] = t if keep is None else keep[t]
    return out


# --- gpu: cuda/sampling.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "sampling_f32": ("logits:f32*", "temperature:f32*", "top_k:i32*", "top_p:f32*", "min_p:f32*",
                     "uniforms:f32*", "out:i32*", "B:i32", "V:i32"),
    "mask_logits_f32": ("logits:f32*", "mask:i32*", "B:i32", "W:i32", "V:i32"),
}


def gpu(logits, temperature, top_k, top_p, min_p, uniforms, out, *, mask=None):
    """Same contract as ``ref`` on CuPy arrays (parameters are device arrays [B], so one
    captured graph serves every mix of requests); ``out`` int32[B] is required. Sort-free: see
    the header of cuda/sampling.cu. With a mask, the logits are copied and mask_logits_f32 sets
    the disallowed ones to -inf first (all -1 words are skipped); without one nothing changes."""
    from freetoken.kernels import _cuda
    B, V = logits.shape
    if mask is not None:
        W = (V + 31) // 32
        assert mask.shape == (B, W), (mask.shape, B, W)
        logits = logits.copy()
        margs = _cuda.bind(ARGS["mask_logits_f32"], logits=logits, mask=mask, B=B, W=W, V=V)
        _cuda.launch(_cuda.kernel("sampling", "mask_logits_f32"), (B,), (_cuda.threads(W),), margs)
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("min_p", min_p), ("uniforms", uniforms), ("out", out)):
        assert a.shape == (B,), (name, a.shape, B)
    args = _cuda.bind(ARGS["sampling_f32"], logits=logits, temperature=temperature, top_k=top_k,
                      top_p=top_p, min_p=min_p, uniforms=uniforms, out=out, B=B, V=V)
    _cuda.launch(_cuda.kernel("sampling", "sampling_f32"), (B,), (_cuda.threads(V),), args)
    return out
