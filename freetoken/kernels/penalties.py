"""Logit adjustments before sampling: repetition, frequency and presence penalties and logit_bias;
pairs: cuda/penalties.cu, tests/kernels/test_penalties.py.

The adjusted tokens of a batch are a sparse list of N entries (rows[n], tokens[n]), each
(row, token) at most once; every other logit is copied unchanged. Per entry, with z its logit,
c = counts[n] (times the token occurs in the request's output so far) and seen = c > 0 or
prompt[n] != 0 (the token occurs in the prompt):
    r = repetition[row]; if r != 1 and seen: z = z / r when z > 0, else z * r   (CTRL / HF rule)
    z = z - frequency[row] * c                                                   (OpenAI rule)
    z = z - presence[row] * (1 if c > 0 else 0)
    z = z + bias[n]                                                              (logit_bias)
each step rounded to float32 in that order (no fused multiply-add), so every backend writes the
same bits. Penalties follow vLLM: frequency and presence count output tokens only, repetition
counts prompt and output tokens. ``out`` may be ``logits`` itself (in place).
"""
import numpy as np

ONE = np.float32(1.0)


def ref(logits, rows, tokens, counts, prompt, bias, presence, frequency, repetition, out=None):
    """logits f32[B,V]; rows, tokens, counts, prompt int32[N]; bias f32[N];
    presence, frequency, repetition f32[B] -> f32[B,V] (``out``)."""
    if out is None:
        out = logits.copy()
    elif out is not logits:
        out[...] = logits
    for n in range(rows.shape[0]):
        b, t, c = int(rows[n]), int(tokens[n]), int(counts[n])
        z = np.float32(logits[b, t])
        r = np.float32(repetition[b])
        if r != ONE and (c > 0 or prompt[n] != 0):
            z = np.float32(z / r) if z > 0 else np.float32(z * r)
        z = np.float32(z - np.float32(frequency[b] * np.float32(c)))
        if c > 0:
            z = np.float32(z - np.float32(presence[b]))
        out[b, t] = np.float32(z + np.float32(bias[n]))
    return out
