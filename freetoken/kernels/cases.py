"""Random inputs per op for ``python -m freetoken kernel`` and the wrapper dry runs of
tests/kernels/test_signatures.py: ``build(op, dims, dtype, rng) -> Case``.

A Case holds host inputs in the op's argument order, how to preallocate ``out`` on a backend,
which arrays hold the results, and napkin numbers for a benchmark: the bytes a call must move at
least (each input read once, each output written once) and its flops. Default dims are decode
sized, from Qwen3-30B-A3B (H 2048, 32 query heads, 4 kv heads, D 128, 128 experts, k 8), and for
the Gated DeltaNet ops from Qwen3.6 (16 key heads and 32 value heads of 128, conv kernel 4).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from freetoken.kernels._bf16 import from_f32
from freetoken.kernels.qformats import FORMATS, random_blocks

BLOCK_DTYPES = tuple(f.name for f in FORMATS)    # --dtype q4_k, ...: weights in a quantized format
BLOCK_OPS = ("embedding", "linear", "experts")   # the ops whose weights may be one


@dataclass(frozen=True)
class Case:
    op: str
    dims: dict
    inputs: tuple          # host arrays and scalars, in the op's argument order (no out)
    make_out: Callable     # xp -> preallocated out (array or tuple); None: writes its inputs
    results: Callable      # (inputs, out) -> {name: array} to compare after a call
    nbytes: int
    flops: int = 0
    tol: tuple = field(default=(1e-4, 1e-4))   # (atol, rtol) for float results; ints exact
    atol_of_max: bool = False      # atol is a fraction of the result's largest magnitude


def _weights(rng, shape, dtype, scale=1.0):
    if dtype in BLOCK_DTYPES:          # random blocks (rows of shape[-1] values): speed and agreement only
        return random_blocks(dtype, shape[:-1], shape[-1], rng)
    w = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return from_f32(w) if dtype == "bf16" else w


def _wb(dtype):
    return 2 if dtype == "bf16" else 4


def _tol(dtype, tol):
    """Case fields of a result's tolerance: a block format's random weights give sums of any size,
    so their atol is 1e-4 of the result's largest magnitude (the kernel tests' bound)."""
    return dict(tol=(1e-4, 1e-4), atol_of_max=True) if dtype in BLOCK_DTYPES else dict(tol=tol)


def _out(shape, dtype=np.float32):
    return lambda xp: xp.empty(shape, dtype)


def _only_out(ins, out):
    return {"out": out}


def _embedding(d, dtype, rng):
    T, H, V = d["T"], d["H"], d["V"]
    ids = rng.integers(0, V, T).astype(np.int32)
    table = _weights(rng, (V, H), dtype)
    return Case("embedding", d, (ids, table), _out((T, H)), _only_out,
                nbytes=T * (table[0].nbytes + 4 * H) + 4 * T, tol=(0, 0))


def _rms_norm(d, dtype, rng):
    R, H = d["R"], d["H"]
    x = _weights(rng, (R, H), "f32", 3.0)
    return Case("rms_norm", d, (x, _weights(rng, H, dtype), 1e-6), _out((R, H)), _only_out,
                nbytes=8 * R * H + _wb(dtype) * H, flops=4 * R * H)


def _add_rms_norm(d, dtype, rng):
    R, H = d["R"], d["H"]
    x, res = _weights(rng, (R, H), "f32", 3.0), _weights(rng, (R, H), "f32")
    return Case("add_rms_norm", d, (x, res, _weights(rng, H, dtype), 1e-6), _out((R, H)),
                lambda ins, out: {"x": ins[0], "out": out},
                nbytes=16 * R * H + _wb(dtype) * H, flops=5 * R * H)


def _rope(d, dtype, rng):
    T, nh, D, R = d["T"], d["nh"], d["D"], d["R"]
    x = _weights(rng, (T, nh, D), "f32")
    pos = rng.integers(0, 32768, T).astype(np.int32)
    inv_freq = (1.0 / 1e6 ** (np.arange(0, R, 2) / R)).astype(np.float32)
    return Case("rope", d, (x, pos, inv_freq), _out((T, nh, D)), _only_out,
                nbytes=8 * T * nh * D + 4 * T + 2 * R, flops=3 * T * nh * R, tol=(2e-5, 1e-4))


def _kv_write(d, dtype, rng):
    T, G, D, N = d["T"], d["G"], d["D"], d["N"]
    k, v = _weights(rng, (T, G, D), "f32"), _weights(rng, (T, G, D), "f32")
    cache_dtype = np.uint16 if dtype == "bf16" else np.float32
    caches = np.zeros((N, G, D), cache_dtype), np.zeros((N, G, D), cache_dtype)
    slots = rng.permutation(N)[:T].astype(np.int32)
    return Case("kv_write", d, (k, v, *caches, slots), None,
                lambda ins, out: {"k_cache": ins[2], "v_cache": ins[3]},
                nbytes=2 * T * G * D * (4 + _wb(dtype)) + 4 * T, tol=(0, 0))


def _router(d, dtype, rng):
    T, E, k = d["T"], d["E"], d["k"]
    logits = _weights(rng, (T, E), "f32", 2.0)
    return Case("router", d, (logits, k, True),
                lambda xp: (xp.empty((T, k), np.int32), xp.empty((T, k), np.float32)),
                lambda ins, out: {"ids": out[0], "weights": out[1]},
                nbytes=4 * T * E + 8 * T * k, flops=3 * T * E, tol=(1e-6, 1e-5))


def _sampling(d, dtype, rng):
    B, V = d["B"], d["V"]
    logits = _weights(rng, (B, V), "f32", 3.0)
    rows = np.arange(B)
    temperature = np.where(rows % 4 == 0, 0.0, 0.8).astype(np.float32)   # every 4th row greedy
    top_k = np.where(rows % 3 == 1, 50, 0).astype(np.int32)
    top_p = np.where(rows % 2 == 1, 0.9, 1.0).astype(np.float32)
    min_p = np.where(rows % 5 == 2, 0.05, 0.0).astype(np.float32)
    uniforms = rng.random(B, dtype=np.float32)
    return Case("sampling", d, (logits, temperature, top_k, top_p, min_p, uniforms),
                _out(B, np.int32), _only_out, nbytes=4 * B * V + 24 * B)


def _penalties(d, dtype, rng):
    """N distinct (row, token) entries over the batch; rows cycle through each penalty off and
    on (repetition both above and below 1), about half the entries biased in [-100, 100], and
    counts 0 with the prompt flag 1 (repetition without frequency/presence)."""
    B, V, N = d["B"], d["V"], d["N"]
    logits = _weights(rng, (B, V), "f32", 3.0)               # both signs: both repetition branches
    flat = np.sort(rng.choice(B * V, N, replace=False))      # unique entries, grouped by row
    rows, tokens = (flat // V).astype(np.int32), (flat % V).astype(np.int32)
    counts = np.where(rng.random(N) < 0.4, 0, rng.integers(1, 9, N)).astype(np.int32)
    prompt = (rng.random(N) < 0.5).astype(np.int32)
    bias = np.where(rng.random(N) < 0.5, rng.uniform(-100, 100, N), 0).astype(np.float32)
    b = np.arange(B)
    presence = np.where(b % 2 == 1, 0.5, 0.0).astype(np.float32)
    frequency = np.where(b % 3 == 1, 0.3, 0.0).astype(np.float32)
    repetition = np.array([1.0, 1.1, 1.3, 0.8])[b % 4].astype(np.float32)
    return Case("penalties", d, (logits, rows, tokens, counts, prompt, bias, presence, frequency,
                                 repetition), _out((B, V)), _only_out,
                nbytes=8 * B * V + 20 * N + 12 * B, flops=6 * N, tol=(0, 0))
def _logprobs(d, dtype, rng):
    """Odd rows hold integer logits: many exact ties, inside the top k and across its edge."""
    B, V, k = d["B"], d["V"], d["k"]
    logits = _weights(rng, (B, V), "f32", 3.0)
    logits[1::2] = np.round(logits[1::2])
    chosen = rng.integers(0, V, B).astype(np.int32)
    return Case("logprobs", d, (logits, chosen, k),
                lambda xp: (xp.empty(B, np.float32), xp.empty((B, k), np.int32),
                            xp.empty((B, k), np.float32)),
                lambda ins, out: {"lp_chosen": out[0], "top_ids": out[1], "top_lp": out[2]},
                nbytes=4 * B * V + 8 * B + 8 * B * k, flops=3 * B * V, tol=(1e-5, 1e-6))


def _gdn_conv(d, dtype, rng):
    """B sequences in shuffled state slots of N, sequence b with L - b % L tokens (decode: L = 1;
    L > 1 mixes lengths, some under K-1), states nonzero as for continuing sequences."""
    B, L, C, K, N = d["B"], d["L"], d["C"], d["K"], d["N"]
    lens = L - np.arange(B) % L
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(starts[-1])
    x = _weights(rng, (T, C), "f32")
    states = _weights(rng, (N, K - 1, C), "f32")
    slots = rng.permutation(N)[:B].astype(np.int32)
    return Case("gdn_conv", d, (x, _weights(rng, (C, K), dtype, 0.5), states, slots, starts),
                _out((T, C)), lambda ins, out: {"out": out, "conv_states": ins[2]},
                nbytes=8 * T * C + 8 * B * (K - 1) * C + _wb(dtype) * C * K + 8 * B,
                flops=2 * T * C * K + 4 * T * C, tol=(1e-5, 1e-5))


def _gated_rms_norm(d, dtype, rng):
    R, D = d["R"], d["D"]
    x, z = _weights(rng, (R, D), "f32", 3.0), _weights(rng, (R, D), "f32", 2.0)
    return Case("gated_rms_norm", d, (x, z, _weights(rng, D, dtype), 1e-6), _out((R, D)),
                _only_out, nbytes=12 * R * D + _wb(dtype) * D, flops=9 * R * D, tol=(1e-5, 1e-5))


def _sigmoid_mul(d, dtype, rng):
    """full=1: a gate per element (gated attention); full=0: one per row (the shared expert)."""
    R, D = d["R"], d["D"]
    x = _weights(rng, (R, D), "f32", 2.0)
    gate = _weights(rng, (R, D) if d["full"] else (R, 1), "f32", 3.0)
    return Case("sigmoid_mul", d, (x, gate), _out((R, D)), _only_out,
                nbytes=8 * R * D + 4 * gate.size, flops=4 * R * D, tol=(1e-6, 1e-5))


def _linear(d, dtype, rng):
    T, K, M = d["T"], d["K"], d["M"]
    x, w = _weights(rng, (T, K), "f32"), _weights(rng, (M, K), dtype, K ** -0.5)
    return Case("linear", d, (x, w), _out((T, M)), _only_out,
                nbytes=w.nbytes + 4 * T * (K + M), flops=2 * T * K * M, **_tol(dtype, (1e-3, 1e-3)))


def _attention(d, dtype, rng):
    """Decode: B sequences with C cached tokens each, one query token per sequence."""
    B, C, Hq, G, D = d["B"], d["C"], d["Hq"], d["G"], d["D"]
    q = _weights(rng, (B, Hq, D), "f32")
    k_cache, v_cache = _weights(rng, (B * C, G, D), dtype), _weights(rng, (B * C, G, D), dtype)
    slot_table = rng.permutation(B * C).astype(np.int32).reshape(B, C)
    tok_seq, tok_pos = np.arange(B, dtype=np.int32), np.full(B, C - 1, np.int32)
    return Case("attention", d, (q, k_cache, v_cache, slot_table, tok_seq, tok_pos, D ** -0.5),
                _out((B, Hq, D)), _only_out,
                nbytes=2 * B * C * G * D * _wb(dtype) + 8 * B * Hq * D + 4 * B * C,
                flops=4 * B * Hq * C * D, tol=(1e-4, 1e-3))


def _experts(d, dtype, rng):
    T, H, I, S, k = d["T"], d["H"], d["I"], d["S"], d["k"]
    x = _weights(rng, (T, H), "f32")
    ids = np.stack([rng.permutation(S)[:k] for _ in range(T)]).astype(np.int32)
    ids[0, -1] = -1                                   # a CPU-routed entry contributes nothing
    w = rng.random((T, k), dtype=np.float32)
    gate_up, down = _weights(rng, (S, 2 * I, H), dtype, H ** -0.5), _weights(rng, (S, H, I), dtype, I ** -0.5)
    used = np.unique(ids[ids >= 0]).size
    return Case("experts", d, (x, ids, w, gate_up, down), _out((T, H)), _only_out,
                nbytes=used * (gate_up[0].nbytes + down[0].nbytes) + 8 * T * H,
                flops=6 * int((ids >= 0).sum()) * I * H, **_tol(dtype, (1e-3, 1e-3)))


def _gdn_rule(d, dtype, rng):
    """B sequences of T tokens each (decode: T = 1), in shuffled state rows of N, the states
    non-zero (a running sequence); gates spread as in a trained model (A up to 16, one head past
    softplus's linear threshold). fp32 only: ``dtype`` is unused."""
    B, T, Hk, Hv, Dk, Dv, N = (d[n] for n in ("B", "T", "Hk", "Hv", "Dk", "Dv", "N"))
    if N < B or Hv % Hk:
        raise ValueError(f"gdn_rule: need N >= B and Hv % Hk == 0, got {d}")
    R = B * T
    f = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    a = f(R, Hv) * 2
    a[:, 0] = 25.0
    A_log = np.log(rng.uniform(1.0, 16.0, Hv)).astype(np.float32)
    states = f(N, Hv, Dk, Dv) * np.float32(0.1)
    slots = rng.permutation(N)[:B].astype(np.int32)
    starts = (np.arange(B + 1) * T).astype(np.int32)
    ins = (f(R, Hk, Dk), f(R, Hk, Dk), f(R, Hv, Dv), a, f(R, Hv), A_log, f(Hv) - 2, states,
           slots, starts)
    state_bytes = 2 * B * Hv * Dk * Dv * 4                    # read once, written once
    return Case("gdn_rule", d, ins, _out((R, Hv, Dv)),
                lambda ins, out: {"out": out, "states": ins[7]},
                nbytes=state_bytes + 4 * R * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv),
                flops=7 * R * Hv * Dk * Dv, tol=(2e-5, 1e-4))


OPS = {  # op -> (default dims, builder)
    "embedding": (dict(T=64, H=2048, V=8192), _embedding),
    "rms_norm": (dict(R=64, H=2048), _rms_norm),
    "add_rms_norm": (dict(R=64, H=2048), _add_rms_norm),
    "rope": (dict(T=64, nh=32, D=128, R=128), _rope),
    "kv_write": (dict(T=64, G=4, D=128, N=4096), _kv_write),
    "router": (dict(T=64, E=128, k=8), _router),
    "sampling": (dict(B=8, V=151936), _sampling),
    "penalties": (dict(B=8, V=151936, N=2048), _penalties),
    "logprobs": (dict(B=8, V=151936, k=20), _logprobs),
    "linear": (dict(T=4, K=2048, M=4096), _linear),
    "attention": (dict(B=4, C=1024, Hq=32, G=4, D=128), _attention),
    "experts": (dict(T=4, H=2048, I=768, S=16, k=8), _experts),
    # Gated DeltaNet (Qwen3.6 decode, 4 sequences): conv channels 2*16*128 + 32*128, kernel 4;
    # the output norm per value head (4 tokens x 32 heads of 128); the attention output gate
    "gdn_conv": (dict(B=4, L=1, C=8192, K=4, N=16), _gdn_conv),
    "gated_rms_norm": (dict(R=128, D=128), _gated_rms_norm),
    "sigmoid_mul": (dict(R=4, D=4096, full=1), _sigmoid_mul),
    # Qwen3.6's GDN layer at decode: 4 sequences x 1 token (T = tokens per sequence)
    "gdn_rule": (dict(B=4, T=1, Hk=16, Hv=32, Dk=128, Dv=128, N=8), _gdn_rule),
}


def build(op: str, dims: dict | None = None, dtype: str = "bf16", rng=None) -> Case:
    """A fresh Case; ``dims`` override the op's defaults by name (unknown names raise)."""
    defaults, builder = OPS[op]
    if dtype in BLOCK_DTYPES and op not in BLOCK_OPS:
        raise ValueError(f"{op}: --dtype {dtype} is a quantized weight format; only {', '.join(BLOCK_OPS)} "
                         "take one")
    unknown = set(dims or ()) - set(defaults)
    if unknown:
        raise ValueError(f"{op}: unknown dims {sorted(unknown)}; expected {sorted(defaults)}")
    return builder({**defaults, **(dims or {})}, dtype, rng or np.random.default_rng(0))


def run(fn, case: Case, xp):
    """Call ``fn`` on fresh copies of the inputs (``xp`` arrays) and a fresh ``out``; returns
    (inputs, out) so ``case.results`` can pick the written arrays."""
    ins = tuple(xp.array(a) if isinstance(a, np.ndarray) else a for a in case.inputs)
    out = case.make_out(xp) if case.make_out else None
    fn(*ins, out) if out is not None else fn(*ins)
    return ins, out


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
