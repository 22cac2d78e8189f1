"""Top-k softmax router; pairs: cuda/router.cu, tests/kernels/test_router.py.

Softmax over E in fp32, then the k largest probabilities, ordered by probability descending with
ties going to the lower expert id; renormalised over the k when ``norm_topk_prob`` is set.
``out`` (optional) is a preallocated (ids int32[T,k], weights f32[T,k]) pair.

Non-finite logits (every implementation follows ``ref``): a NaN probability ranks below every
number, and among NaNs the lower id comes first, so k distinct valid ids always come back and no
token's MoE output is dropped. A NaN or +inf logit, or a row of -inf, makes the row's sum NaN and
so every probability NaN: ids 0 .. k-1, weights NaN (the NaN reaches the output rather than a
made-up routing). A -inf logit among finite ones is probability 0.
"""
import numpy as np

from freetoken.kernels._numba import SERIAL, njit


def ref(logits, k, norm_topk_prob, out=None):
    """logits f32[T,E] -> (ids int32[T,k], weights f32[T,k])."""
    x = np.asarray(logits, np.float32)
    with np.errstate(invalid="ignore"):                 # non-finite rows: the rule above
        p = np.exp(x - x.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")[:, :k]        # stable: ties -> lower id; NaN last
    w = np.take_along_axis(p, order, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    if out is None:
        return order.astype(np.int32), w.astype(np.float32)
    out[0][...] = order
    out[1][...] = w
    return out


@njit(**SERIAL)
def _route(x, k, norm, ids, w):
    # serial: T is small at decode and k passes over E beat a sort for k << E
    T, E = x.shape
    p = np.empty(E, np.float32)
    taken = np.zeros(E, np.bool_)
    for t in range(T):
        m = x[t].max()
        for e in range(E):
            p[e] = np.exp(x[t, e] - m)
        p /= p.sum()
        taken[:] = False
        for j in range(k):
            best = -1
            for e in range(E):              # strict > keeps the lowest id among equals
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            w[t, j] = p[best]
        if norm:
            w[t] /= w[t].sum()


def cpu(logits, k, norm_topk_prob, out=None):
    """Same contract as ``ref``."""
    x = np.ascontiguousarray(logits, np.float32)
    T, E = x.shape
    assert 0 < k <= E, (k, E)
    if out is None:
        out = (np.empty((T, k), np.int32), np.empty((T, k), np.float32))
    _route(x, int(k), bool(norm_topk_prob), out[0], out[1])
    return out


# --- gpu: cuda/router.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "router_f32": ("logits:f32*", "ids:i32*", "weights:f32*", "T:i32", "E:i32", "k:i32",
                   "norm:i32"),
}
MAX_K = 32        # router.cu keeps the chosen experts in fixed shared arrays
MAX_E = (48 * 1024 - 640) // 4   # the row's probabilities and router.cu's 640 B of static
                                 # shared memory in 48 KiB (12128)


def gpu(logits, k, norm_topk_prob, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` (ids int32[T,k], weights f32[T,k]) is
    required."""
    from freetoken.kernels import _cuda
    T, E = logits.shape
    ids, weights = out
    assert 0 < k <= min(E, MAX_K) and E <= MAX_E, (k, E)
    assert ids.shape == weights.shape == (T, k), (ids.shape, weights.shape, (T, k))
    args = _cuda.bind(ARGS["router_f32"], logits=logits, ids=ids, weights=weights, T=T, E=E, k=k,
                      norm=int(bool(norm_topk_prob)))
    _cuda.launch(_cuda.kernel("router", "router_f32"), (T,), (_cuda.threads(E, 256),), args,
                 shared_mem=4 * E)
    return out
