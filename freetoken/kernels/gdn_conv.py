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

Non-finite inputs (every implementation follows ``ref``): the only sum runs over one channel's K
taps, so a NaN or inf in x[t, c] or a state entry of channel c reaches only the outputs at c
whose window (in its own sequence) holds it (NaN; for an inf, +inf or NaN: silu(-inf) is
-inf / inf), and its sequence's state row while it is among the last K-1 inputs.
"""
import numpy as np

from freetoken.kernels._activations import silu
from freetoken.kernels._bf16 import to_f32
from freetoken.kernels._numba import HOT, SERIAL, njit, prange, widen


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


# --- cpu: numba --------------------------------------------------------------------------------

CHANNELS = 512  # channels per block: 16 parallel items at C = 8192; 2 KiB of state rows each


@njit(**SERIAL)
def _check(slots, starts, N, T):
    """Refuse what the kernels would read or write out of bounds, and a slot named twice (two
    sequences updating one state row: the gpu would race)."""
    B = slots.shape[0]
    if starts.shape[0] != B + 1 or starts[0] != 0 or starts[B] != T:
        raise ValueError("gdn_conv: seq_starts must be [B+1] from 0 to T")
    for b in range(B):
        if starts[b + 1] < starts[b]:
            raise ValueError("gdn_conv: seq_starts must not decrease")
        if slots[b] < 0 or slots[b] >= N:
            raise IndexError("gdn_conv: a seq_slot is out of range")
        for o in range(b):
            if slots[o] == slots[b]:
                raise ValueError("gdn_conv: a state slot is named by two sequences")


@njit(**SERIAL)
def _conv_seq(x, wt, st, s, n, out, c0, acc):
    """One sequence's tokens over channels c0:c0+m (m = acc's length), then its state row's
    update there. Window rows come whole from the state or from x, so no channel loop
    branches and all of them run over contiguous memory (they vectorize)."""
    K, m = wt.shape[0], acc.shape[0]
    for i in range(n):
        acc[:] = np.float32(0.0)
        for j in range(K):
            p = i - (K - 1) + j                      # input position; < 0: from the state
            row = st[K - 1 + p, c0:c0 + m] if p < 0 else x[s + p, c0:c0 + m]
            wj = wt[j]
            for c in range(m):
                acc[c] += wj[c] * row[c]
        o = out[s + i, c0:c0 + m]
        for c in range(m):
            o[c] = silu(acc[c])
    if n == 0:
        return
    for r in range(K - 1):                           # ascending: row r + n is read before written
        p = n - (K - 1) + r
        st[r, c0:c0 + m] = st[r + n, c0:c0 + m] if p < 0 else x[s + p, c0:c0 + m]


@njit(**SERIAL)
def _channel_block(x, w, states, slots, starts, out, c0):
    """Every sequence over channels c0:c0+CHANNELS. The weights are widened into [K, m] first,
    j outer, so the channel loops read contiguous fp32: widening weight[c, j] at stride K
    inside them made a Qwen3.6 decode step of 4 sequences 81 us instead of 38 on the dev box."""
    C, K = w.shape
    m = min(C, c0 + CHANNELS) - c0
    wt = np.empty((K, m), np.float32)
    for j in range(K):
        for c in range(m):
            wt[j, c] = widen(w[c0 + c, j])
    acc = np.empty(m, np.float32)
    for b in range(slots.shape[0]):
        _conv_seq(x, wt, states[slots[b]], starts[b], starts[b + 1] - starts[b], out, c0, acc)


# Two drivers of the same blocks (each channel's state is its own, so blocks never share a
# write): decode runs serially, where a parallel region costs more than the ~40 us of work and,
# on a loaded machine, waits milliseconds for a descheduled worker; a prefill runs in parallel.
PARALLEL_MIN = 1 << 18  # T*C from which the parallel driver runs: 32 tokens at C = 8192


@njit(**SERIAL)
def _gdn_conv_serial(x, w, states, slots, starts, out):
    for q in range((w.shape[0] + CHANNELS - 1) // CHANNELS):
        _channel_block(x, w, states, slots, starts, out, q * CHANNELS)


@njit(**HOT)
def _gdn_conv_parallel(x, w, states, slots, starts, out):
    for q in prange((w.shape[0] + CHANNELS - 1) // CHANNELS):
        _channel_block(x, w, states, slots, starts, out, q * CHANNELS)


def cpu(x, weight, conv_states, seq_slots, seq_starts, out=None):
    """Same contract as ``ref``; seq_starts must run from 0 to T and each slot appear once."""
    x = np.ascontiguousarray(x, np.float32)
    T, C = x.shape
    K = weight.shape[1]
    assert weight.shape == (C, K) and conv_states.shape[1:] == (K - 1, C), (
        x.shape, weight.shape, conv_states.shape)
    assert conv_states.dtype == np.float32 and conv_states.flags.c_contiguous
    slots = np.ascontiguousarray(seq_slots, np.int32)
    starts = np.ascontiguousarray(seq_starts, np.int32)
    _check(slots, starts, conv_states.shape[0], T)
    if out is None:
        out = np.empty_like(x)
    run = _gdn_conv_parallel if T * C >= PARALLEL_MIN else _gdn_conv_serial
    run(x, np.ascontiguousarray(weight), conv_states, slots, starts, out)
    return out


# --- gpu: cuda/gdn_conv.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "gdn_conv_bf16": ("x:f32*", "w:u16*", "states:f32*", "slots:i32*", "starts:i32*", "out:f32*",
                      "C:i32", "K:i32"),
    "gdn_conv_f32": ("x:f32*", "w:f32*", "states:f32*", "slots:i32*", "starts:i32*", "out:f32*",
                     "C:i32", "K:i32"),
}
MAX_K = 8       # the kernel keeps the window in registers (Qwen3-Next / Qwen3.5: K = 4)
TOKENS = 64     # tokens of one sequence per thread (cuda/gdn_conv.cu: must be >= K - 1)
CHANNEL_THREADS = 256


def gpu(x, weight, conv_states, seq_slots, seq_starts, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,C] is required. seq_starts must
    run from 0 to T and each slot appear once; the device cannot check that without a sync, so
    it is the caller's (cpu refuses both). Grid: channel blocks x sequences x chunks of TOKENS
    tokens, as many chunks as the longest possible sequence (T) needs; empty ones exit."""
    from freetoken.kernels import _cuda
    T, C = x.shape
    K = weight.shape[1]
    B = seq_slots.shape[0]
    assert weight.shape == (C, K) and conv_states.shape[1:] == (K - 1, C), (
        x.shape, weight.shape, conv_states.shape)
    assert 1 <= K <= MAX_K, ("K", K, MAX_K)
    assert seq_starts.shape == (B + 1,) and out.shape == (T, C), (seq_starts.shape, out.shape)
    entry = f"gdn_conv_{_cuda.dtype_tag(weight)}"
    args = _cuda.bind(ARGS[entry], x=x, w=weight, states=conv_states, slots=seq_slots,
                      starts=seq_starts, out=out, C=C, K=K)
    block = _cuda.threads(C, CHANNEL_THREADS)
    grid = ((C + block - 1) // block, B, (T + TOKENS - 1) // TOKENS)
    assert grid[2] <= 65535, ("T", T)
    _cuda.launch(_cuda.kernel("gdn_conv", entry), grid, (block,), args)
    return out
