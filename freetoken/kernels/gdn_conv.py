"""Gated DeltaNet's short causal depthwise conv1d + SiLU over a varlen batch, with the per
sequence conv state updated in place; pairs: cuda/gdn_conv.cu, tests/kernels/test_gdn_conv.py.

Sequence b owns tokens seq_starts[b]:seq_starts[b+1] (in time order) and state row
conv_states[seq_slots[b]] f32[K-1, C]: the K-1 inputs before its first token, oldest first
(zeros for a new sequence). With u = (state row, then the sequence's x rows) and token i of the
sequence at u[K-1+i]:
    out[t, c] = silu(sum_j weight[c, j] * u[i + j, c])      j = 0..K-1, fp32
so weight[:, K-1] multiplies x[t] (torch's conv1d with K-1 left padding, HF's conv1d.weight
[C,1,K] stored as [C,K]). Afterwards the state row holds the last K-1 rows of u: the sequence's
last K-1 inputs, older state entries kept when it brought fewer than K-1 tokens. Rows of
conv_states no sequence names are untouched.
"""
import numpy as np

from freetoken.kernels._bf16 import to_f32


def _silu(a):
    with np.errstate(over="ignore"):               # exp(-a) -> inf for a << 0: silu -> -0
        return a / (np.float32(1.0) + np.exp(-a))


def ref(x, weight, conv_states, seq_slots, seq_starts, out=None):
    """x f32[T,C], weight [C,K] (bf16 bits or f32), conv_states f32[N,K-1,C] (updated in place),
    seq_slots int32[B], seq_starts int32[B+1] -> f32[T,C]."""
    x = np.asarray(x, np.float32)
    w = to_f32(weight)                              # [C,K]
    K = w.shape[1]
    res = np.zeros(x.shape, np.float32)
    for b in range(len(seq_slots)):
        s, e, slot = int(seq_starts[b]), int(seq_starts[b + 1]), int(seq_slots[b])
        u = np.concatenate([conv_states[slot], x[s:e]])          # [K-1+n, C]
        for i in range(e - s):
            acc = np.zeros(x.shape[1], np.float32)
            for j in range(K):
                acc += w[:, j] * u[i + j]
            res[s + i] = _silu(acc)
        if K > 1:                                   # u[-0:] would be all of u
            conv_states[slot] = u[-(K - 1):]
    if out is None:
        return res
    out[...] = res
    return out
