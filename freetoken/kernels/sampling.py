"""Token sampling from logits with temperature, top-k, top-p and min-p; pairs: cuda/sampling.cu,
tests/kernels/test_sampling.py.

Per row: temperature <= 0 -> argmax (ties -> lowest id). Otherwise p = softmax(logits * (1/T));
order tokens by p descending (ties -> lower id); keep the first top_k (<= 0: all) and
renormalise them; keep the shortest prefix whose mass reaches top_p (token i stays while the mass
before it is < top_p; top_p <= 0 or >= 1: all); drop p < min_p * p_max; drop p == 0; renormalise;
return the first token whose cumulative probability exceeds the row's uniform u in [0, 1).
"""
import numpy as np

FIRST_PREFIX = 64  # cpu: sorted candidates tried first; typical LLM rows decide within these


def _probs(z, temperature):
    z = np.asarray(z, np.float32) * (np.float32(1.0) / np.float32(temperature))
    p = np.exp(z - z.max())
    return p / p.sum()


def _pick(q, u):
    """Inverse CDF over kept probabilities q (descending): index of the first cumsum > u."""
    c = np.cumsum(q / q.sum())
    return min(int(np.searchsorted(c, np.float32(u), side="right")), q.shape[0] - 1)


def _ref_row(z, temperature, top_k, top_p, min_p, u):
    if temperature <= 0:
        return int(np.argmax(z))
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


def ref(logits, temperature, top_k, top_p, min_p, uniforms, out=None):
    """logits f32[B,V], temperature f32[B], top_k int32[B], top_p f32[B], min_p f32[B],
    uniforms f32[B] -> int32[B]."""
    B = logits.shape[0]
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


def _cpu_row(z, temperature, top_k, top_p, min_p, u):
    """``_ref_row`` without sorting the vocabulary: filter a sorted prefix of the order, and
    double it until the kept set ends inside it (or, with no filter, the CDF passes u)."""
    if temperature <= 0:
        return int(np.argmax(z))
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


def cpu(logits, temperature, top_k, top_p, min_p, uniforms, out=None):
    """Same contract as ``ref``; avoids the full vocabulary sort (milliseconds at V = 150k)."""
    B = logits.shape[0]
    out = np.empty(B, np.int32) if out is None else out
    for b in range(B):
        out[b] = _cpu_row(logits[b], temperature[b], top_k[b], top_p[b], min_p[b], uniforms[b])
    return out


# --- gpu: cuda/sampling.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "sampling_f32": ("logits:f32*", "temperature:f32*", "top_k:i32*", "top_p:f32*", "min_p:f32*",
                     "uniforms:f32*", "out:i32*", "B:i32", "V:i32"),
}


def gpu(logits, temperature, top_k, top_p, min_p, uniforms, out):
    """Same contract as ``ref`` on CuPy arrays (parameters are device arrays [B], so one
    captured graph serves every mix of requests); ``out`` int32[B] is required. Sort-free: see
    the header of cuda/sampling.cu."""
    from freetoken.kernels import _cuda
    B, V = logits.shape
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("min_p", min_p), ("uniforms", uniforms), ("out", out)):
        assert a.shape == (B,), (name, a.shape, B)
    args = _cuda.bind(ARGS["sampling_f32"], logits=logits, temperature=temperature, top_k=top_k,
                      top_p=top_p, min_p=min_p, uniforms=uniforms, out=out, B=B, V=V)
    _cuda.launch(_cuda.kernel("sampling", "sampling_f32"), (B,), (_cuda.threads(V),), args)
    return out
