"""Log-probabilities for the OpenAI ``logprobs`` fields; pairs: cuda/logprobs.cu,
tests/kernels/test_logprobs.py.

Per row b of logits: lp = log_softmax(logits[b]) in float32 (lp_t = z_t - m - log(sum_j exp(z_j - m)),
m the row max). Writes lp[chosen[b]] and the K most probable tokens of the row with their lp, in
descending order, ties -> lower id (the sampling op's order). K may be 0. Rows are the engine's raw
logits (before temperature, penalties, logit_bias and grammar masks), as vLLM reports by default.
Used for sampled tokens (one row per sequence) and for prompt tokens (one row per position,
chosen = the next prompt token).

Non-finite rows (every implementation follows ``ref``): the order reads a NaN logit as -inf; a NaN
or +inf logit, or a row of -inf, has no softmax, so every logprob of the row is NaN (NaN is
reported, not a made-up number).

cpu: numba without sorting the vocabulary (its docstring says how its sums differ from ref's);
gpu: one block per row, cuda/logprobs.cu.
"""
import numpy as np

from freetoken.kernels._numba import from_bits, njit, prange


def _log_softmax(z):
    z = np.asarray(z, np.float32)
    m = z.max()
    with np.errstate(invalid="ignore"):                 # non-finite rows: NaN (the rule above)
        return (z - m) - np.float32(np.log(np.exp(z - m, dtype=np.float32).sum(dtype=np.float32)))


def ref(logits, chosen, k, out=None):
    """logits f32[B,V], chosen int32[B], k int -> (f32[B] chosen lp, int32[B,k] top ids,
    f32[B,k] top lp)."""
    B = logits.shape[0]
    if out is None:
        out = (np.empty(B, np.float32), np.empty((B, k), np.int32), np.empty((B, k), np.float32))
    lp_chosen, top_ids, top_lp = out
    for b in range(B):
        lp = _log_softmax(logits[b])
        lp_chosen[b] = lp[chosen[b]]
        z = np.asarray(logits[b], np.float32)
        order = np.argsort(-np.where(np.isnan(z), np.float32(-np.inf), z), kind="stable")[:k]
        top_ids[b], top_lp[b] = order, lp[order]
    return out


# --- cpu ---
# exp of x <= 0 in float32 by Cephes' expf (Cody-Waite reduction to r in [-ln2/2, ln2/2], a
# degree 7 polynomial, 2^-n from its exponent bits; ~1e-7 relative error on [-87, 0], checked by
# tests/kernels/test_logprobs.py): it vectorizes, where np.exp compiles to one libm call per
# element (measured 330 us vs 38 us for a row of 151936 on the dev box). x <= -87 gives 0: those
# terms are below 2^-125 of the row's maximum term, 1, and ref's sum cannot see them either.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)  # HI has 9 bits: n * HI exact
_C0, _C1, _C2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_C3, _C4, _C5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_FLOOR, _HALF, _ONE, _ZERO = np.float32(-87.0), np.float32(0.5), np.float32(1.0), np.float32(0.0)
_BLOCK = 64  # exps summed in float32 per block (vectorized), blocks summed in float64


@njit(inline="always")
def _exp_neg(x):
    xc = x if x > _FLOOR else _FLOOR
    n = np.int32(xc * -_LOG2E + _HALF)              # round(-x log2 e): xc <= 0, so truncation floors
    fn = np.float32(n)
    r = (xc + fn * _LN2_HI) + fn * _LN2_LO
    p = (((((_C0 * r + _C1) * r + _C2) * r + _C3) * r + _C4) * r + _C5) * (r * r) + r + _ONE
    e = p * from_bits(np.uint32(np.int32(127) - n) << np.uint32(23))
    return e if x > _FLOOR else (_ZERO if x == x else x)   # NaN stays NaN: no softmax (ref)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sum_exp(z, m):
    """sum_j exp(z_j - m) over the row, m its max. fastmath is only reassoc (the block sums
    vectorize) and contract (fused multiply-adds in the polynomial: 39 us a row of 151936 instead
    of 56): no nnan/ninf, so -inf logits stay exact zeros, and no nsz, which LLVM needs to fold
    fn * HI + fn * LO into one rounded product (test_exp_against_float64 would see that)."""
    V = z.shape[0]
    nb = V // _BLOCK
    s = 0.0
    for c in range(nb):
        base, acc = c * _BLOCK, _ZERO
        for t in range(_BLOCK):
            acc += _exp_neg(z[base + t] - m)
        s += np.float64(acc)
    for t in range(nb * _BLOCK, V):
        s += np.float64(_exp_neg(z[t] - m))
    return s


@njit(inline="always")
def _insert(x, t, n, k, ids, vals):
    """Put (x, t) into the descending list vals/ids of n <= k entries, after every entry >= x:
    ids arrive ascending, so ties keep the lower id first. Returns the new length."""
    p = n if n < k else k - 1
    while p > 0 and vals[p - 1] < x:
        vals[p], ids[p] = vals[p - 1], ids[p - 1]
        p -= 1
    vals[p], ids[p] = x, t
    return min(n + 1, k)


@njit(cache=True, nogil=True)
def _top(z, k, ids, vals):
    """The k >= 1 largest logits of the row into vals/ids (descending, ties -> lower id), by
    insertion into a k-list. Blocks with no logit above the current k-th are skipped after a
    vectorized count, so a typical row costs one compare per logit."""
    V = z.shape[0]
    n, thr = 0, np.float32(-np.inf)
    for c in range(V // _BLOCK + 1):
        base = c * _BLOCK
        top = min(base + _BLOCK, V)
        if n == k and top - base == _BLOCK:
            above = 0
            for t in range(_BLOCK):
                above += np.int32(z[base + t] > thr)
            if above == 0:
                continue
        for t in range(base, top):
            x = z[t] if z[t] == z[t] else np.float32(-np.inf)     # NaN orders as -inf (ref)
            if n < k or x > thr:
                n = _insert(x, t, n, k, ids, vals)
                thr = vals[k - 1] if n == k else thr
    return vals[0]


@njit(cache=True, nogil=True)
def _row(z, c, k, ids, vals):
    """One row: its top k into ids/vals, and the logprob of token c."""
    if k > 0:
        m = _top(z, k, ids, vals)
    else:                                            # only the max is needed
        m = _top(z, 1, np.empty(1, np.int32), np.empty(1, np.float32))
    logsum = np.float32(np.log(_sum_exp(z, m)))
    for j in range(k):
        vals[j] = (vals[j] - m) - logsum
    return (z[c] - m) - logsum


@njit(cache=True, nogil=True, parallel=True)
def _rows(logits, chosen, k, lp_chosen, top_ids, top_lp):
    for b in prange(logits.shape[0]):
        lp_chosen[b] = _row(logits[b], chosen[b], k, top_ids[b], top_lp[b])


def _check_args(logits, chosen, k):
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"logprobs: logits must be [B, V] with V >= 1, got shape {logits.shape}")
    B, V = logits.shape
    if chosen.shape != (B,):
        raise ValueError(f"logprobs: chosen must be [{B}], got shape {chosen.shape}")
    if not 0 <= k <= V:
        raise ValueError(f"logprobs: k = {k} outside [0, V = {V}]")


def cpu(logits, chosen, k, out=None):
    """Same contract as ``ref``, numba, parallel over rows; no sort of the vocabulary (a top-k
    by insertion, ``_top``). Top ids equal ref's exactly, as both order the raw logits. The
    logprobs differ from ref's by about an ulp of |lp| (1e-6 at lp = -15): the exps come from
    ``_exp_neg`` and are summed in float32 blocks of 64, then in float64 (ref: np.exp and numpy's
    pairwise float32 sum), so log(sum) differs by ~1e-7. chosen ids must lie in [0, V)."""
    logits = np.ascontiguousarray(logits, np.float32)
    chosen = np.ascontiguousarray(chosen, np.int32)
    k = int(k)
    _check_args(logits, chosen, k)
    B, V = logits.shape
    if B and not (0 <= chosen.min() and chosen.max() < V):
        raise ValueError(f"logprobs: chosen ids outside [0, V = {V}]: {chosen.min()}..{chosen.max()}")
    if out is None:
        out = (np.empty(B, np.float32), np.empty((B, k), np.int32), np.empty((B, k), np.float32))
    lp_chosen, top_ids, top_lp = out
    assert lp_chosen.shape == (B,) and top_ids.shape == top_lp.shape == (B, k), \
        (lp_chosen.shape, top_ids.shape, top_lp.shape, B, k)
    assert (lp_chosen.dtype, top_ids.dtype, top_lp.dtype) == (np.float32, np.int32, np.float32)
    if B == 1:      # one row: the parallel launch would only add its ~10 us
        lp_chosen[0] = _row(logits[0], chosen[0], k, top_ids[0], top_lp[0])
    else:
        _rows(logits, chosen, k, lp_chosen, top_ids, top_lp)
    return out


# --- gpu: cuda/logprobs.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "logprobs_f32": ("logits:f32*", "chosen:i32*", "lp_chosen:f32*", "top_ids:i32*", "top_lp:f32*",
                     "B:i32", "V:i32", "k:i32"),
}
MAX_K = 32  # logprobs.cu keeps each thread's k best in fixed local arrays (OpenAI allows k <= 20)


def gpu(logits, chosen, k, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` (lp_chosen f32[B], top_ids int32[B,k],
    top_lp f32[B,k]) is required. k = 0 writes lp_chosen only. One block per row: see the header
    of cuda/logprobs.cu. A chosen id outside [0, V) is not checked here (that needs a sync): the
    kernel writes NaN for it."""
    from freetoken.kernels import _cuda
    k = int(k)
    if k > MAX_K:
        raise ValueError(f"logprobs.gpu: k = {k} is above the kernel's limit MAX_K = {MAX_K} "
                         "(cuda/logprobs.cu keeps each thread's k best in fixed arrays)")
    _check_args(logits, chosen, k)
    B, V = logits.shape
    lp_chosen, top_ids, top_lp = out
    assert lp_chosen.shape == (B,) and top_ids.shape == top_lp.shape == (B, k), \
        (lp_chosen.shape, top_ids.shape, top_lp.shape, B, k)
    args = _cuda.bind(ARGS["logprobs_f32"], logits=logits, chosen=chosen, lp_chosen=lp_chosen,
                      top_ids=top_ids, top_lp=top_lp, B=B, V=V, k=k)
    _cuda.launch(_cuda.kernel("logprobs", "logprobs_f32"), (B,), (_cuda.threads(V),), args)
    return out
