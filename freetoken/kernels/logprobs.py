"""Log-probabilities for the OpenAI ``logprobs`` fields; pairs: cuda/logprobs.cu,
tests/kernels/test_logprobs.py.

Per row b of logits: lp = log_softmax(logits[b]) in float32 (lp_t = z_t - m - log(sum_j exp(z_j - m)),
m the row max). Writes lp[chosen[b]] and the K most probable tokens of the row with their lp, in
descending order, ties -> lower id (the sampling op's order). K may be 0. Rows are the engine's raw
logits (before temperature, penalties, logit_bias and grammar masks), as vLLM reports by default.
Used for sampled tokens (one row per sequence) and for prompt tokens (one row per position,
chosen = the next prompt token).
"""
import numpy as np


def _log_softmax(z):
    z = np.asarray(z, np.float32)
    m = z.max()
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
        order = np.argsort(-logits[b], kind="stable")[:k]
        top_ids[b], top_lp[b] = order, lp[order]
    return out
