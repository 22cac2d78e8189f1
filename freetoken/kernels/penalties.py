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

from freetoken.kernels._numba import njit

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


# not SERIAL: fastmath would let LLVM fuse and reorder the steps; error_model "numpy": a
# repetition of 0 divides to inf as in ref (numba's default raises ZeroDivisionError)
@njit(cache=True, nogil=True, error_model="numpy")
def _apply(logits, rows, tokens, counts, prompt, bias, presence, frequency, repetition, out):
    """ref's loop compiled: numba keeps float32 op float32 in float32 and, without fastmath,
    never contracts a multiply and a subtract into an FMA, so every step rounds as in ref."""
    B, V = logits.shape
    one = np.float32(1.0)
    for n in range(rows.shape[0]):
        b, t, c = rows[n], tokens[n], counts[n]
        if b < 0 or b >= B or t < 0 or t >= V:       # no bounds checks in numba: refuse here
            raise IndexError("penalties: an entry's row or token is out of range")
        z = logits[b, t]
        r = repetition[b]
        if r != one and (c > 0 or prompt[n] != 0):
            z = z / r if z > 0 else z * r
        z = z - frequency[b] * np.float32(c)
        if c > 0:
            z = z - presence[b]
        out[b, t] = z + bias[n]


def cpu(logits, rows, tokens, counts, prompt, bias, presence, frequency, repetition, out=None):
    """Same contract as ``ref``: a numpy copy of the logits (the whole cost at V = 150k; none
    when ``out is logits``), then the N entries in one compiled loop."""
    if out is None:
        out = logits.copy()
    elif out is not logits:
        np.copyto(out, logits)
    if rows.shape[0]:
        _apply(logits, rows, tokens, counts, prompt, bias, presence, frequency, repetition, out)
    return out


# --- gpu: cuda/penalties.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "penalties_f32": ("logits:f32*", "rows:i32*", "tokens:i32*", "counts:i32*", "prompt:i32*",
                      "bias:f32*", "presence:f32*", "frequency:f32*", "repetition:f32*",
                      "out:f32*", "N:i32", "B:i32", "V:i32"),
}
ENTRY_THREADS = 256  # entries per block: N is a few thousand at most, so a handful of blocks


def gpu(logits, rows, tokens, counts, prompt, bias, presence, frequency, repetition, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[B,V] is required (it may be
    ``logits``). The copy is a device copy on the current stream (see cuda/penalties.cu for
    why), then one thread per entry; N == 0 launches nothing."""
    from freetoken.kernels import _cuda
    B, V = logits.shape
    N = rows.shape[0]
    assert out.shape == (B, V), ("out", out.shape, B, V)
    for name, a, n in (("rows", rows, N), ("tokens", tokens, N), ("counts", counts, N),
                       ("prompt", prompt, N), ("bias", bias, N), ("presence", presence, B),
                       ("frequency", frequency, B), ("repetition", repetition, B)):
        assert a.shape == (n,), (name, a.shape, n)
    if out is not logits:
        out[...] = logits
    if N == 0:
        return out
    args = _cuda.bind(ARGS["penalties_f32"], logits=logits, rows=rows, tokens=tokens,
                      counts=counts, prompt=prompt, bias=bias, presence=presence,
                      frequency=frequency, repetition=repetition, out=out, N=N, B=B, V=V)
    block = _cuda.threads(N, ENTRY_THREADS)
    grid = ((N + block - 1) // block,)
    _cuda.launch(_cuda.kernel("penalties", "penalties_f32"), grid, (block,), args)
    return out
