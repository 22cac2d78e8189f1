"""Every layer of a one-token decode step of a Qwen3-MoE model in one numba call (cpu backend):
kernels/decode_layer.py's ``_layer`` (the attention half, then the routed experts from the host
bank) for each layer in turn, x updated in place. Spec: the per-layer calls it replaces
(decode_layer.cpu layer by layer, the same kernel on the same arrays), bit for bit
(tests/kernels/test_decode_stack.py).

Why: between two layers' calls ran 20-30 us of Python a layer, slow because a layer's ~400 us of
weight streaming leaves the interpreter's own data out of cache: ~5% of a Q4_0 medium decode
step on the Zen 4 VM (docs/performance.md).

Taken when the step is one token of one sequence and every layer would take ``_layer``: a MoE
layer whose experts the MoE runtime hands over (``bank``), weights decode_layer.layer_slots takes,
and per-layer slots of one numba type, so that the layers go in as one homogeneous tuple indexed
at run time. A GGUF whose qkv is one array on some layers and two parts (q|k, v of two formats)
on others is given two parts everywhere, the one array split at the same row. Else None, and the
model calls the layers one by one; why is logged once per model.

Shape legend: L layers, T step tokens (1), H hidden, E experts, k routed per token, N KV slots,
G kv heads, D head dim.
"""
import logging
import weakref

import numpy as np

from freetoken.kernels._numba import SERIAL, njit
from freetoken.kernels.decode_layer import OK, _layer, _raise_for, layer_slots, step_arrays
from freetoken.kernels.qinterleave import CODE as X16

logger = logging.getLogger("freetoken")


@njit(**SERIAL)
def _stack(x, layers, k_pool, v_pool, eps, dims, positions, inv_freq, slots, slot_table, tok_seq, scale,
           chunks, norm_topk, logits, ids, weights):
    """x f32[T,H] through each layer of ``layers`` (per layer: norms, qkv_w, o_w, q_norm, k_norm,
    router_w, experts, as _layer takes them), k_pool/v_pool [L,N,G,D]; layer l's route goes to
    ids int32[L,T,k] and weights f32[L,T,k], logits f32[T,E] is the routers' scratch. Returns
    (status, where): OK, or _layer's bad status (at the first layer, before anything is written:
    every layer checks the same slots)."""
    h = np.empty_like(x)
    for layer in range(len(layers)):
        lw = layers[layer]
        status = _layer(x, lw[0], eps, lw[1], lw[2], lw[3], lw[4], dims, positions, inv_freq, k_pool[layer],
                        v_pool[layer], slots, slot_table, tok_seq, scale, chunks, h, lw[5], norm_topk, logits,
                        ids[layer], weights[layer], lw[6])
        if status[0] != OK:
            return status
    return OK, 0


def cpu(x, layers, kv, banks, batch, inv_freq, eps, scale, dims, route, *, dots="f32"):
    """x f32[1,H] through every layer (layers: the model's LayerWeights; kv: its KV pool; banks:
    each layer's host bank (gate_up, down) from the MoE runtime, None where it hands none over)
    in one call; route = (k, norm_topk_prob). Returns each layer's routed ids int32[L,1,k] (for
    the runtime's counters), or None when the step is not this kernel's and the caller runs the
    layers one by one."""
    if (batch.prefill or x.shape[0] != 1 or x.dtype != np.float32 or not x.flags.c_contiguous
            or kv.k.dtype != kv.v.dtype or kv.k.ndim != 4 or kv.k.shape[0] != len(layers)):
        return None                     # (the kernel indexes the pool by layer, unchecked)
    uniform = stack_slots(layers, banks, dots)
    if uniform is None:
        return None
    L, k = len(layers), route[0]
    ids, weights = np.empty((L, 1, k), np.int32), np.empty((L, 1, k), np.float32)
    logits = np.empty((1, layers[0].router.shape[0]), np.float32)
    positions, slots, slot_table, tok_seq, chunks = step_arrays(batch)
    status, where = _stack(x, uniform, kv.k, kv.v, np.float32(eps), dims, positions, inv_freq, slots, slot_table,
                              tok_seq, np.float32(scale), chunks, bool(route[1]), logits, ids, weights)
    _raise_for(status, where, slots, kv.k.shape[1])
    return ids


_kept: dict = {}    # id(layers[0]) -> (weakrefs of the layers, dots, the banks' first arrays, the tuple or None)


def stack_slots(layers, banks, dots):
    """The per-layer slots as one tuple of one numba type, or None (see the module doc); made once
    per model, ``dots`` and banks, and kept while the model's first layer lives (the entry holds
    the weights' arrays)."""
    firsts = [None if b is None else b[0] for b in banks]
    hit = _kept.get(id(layers[0]))
    if (hit is None or len(hit[0]) != len(layers) or any(r() is not lw for r, lw in zip(hit[0], layers))
            or hit[1] != dots or any(a is not b for a, b in zip(hit[2], firsts))):
        uniform, why = _uniform(layers, banks, dots)
        logger.info("cpu decode: %s", "every layer in one call (kernels/decode_stack.py)" if uniform is not None
                    else f"one call a layer ({why})")
        refs = [weakref.ref(lw, None if i else lambda _, key=id(lw): _kept.pop(key, None)) for i, lw in enumerate(layers)]
        hit = _kept[id(layers[0])] = (refs, dots, firsts, uniform)
    return hit[3]


def _uniform(layers, banks, dots):
    """(the layers' slots as a tuple of one numba type, None) or (None, why not)."""
    from numba import typeof
    per_layer = []
    for lw, bank in zip(layers, banks):
        slots = None if bank is None else layer_slots(lw, dots, True, bank)
        qkv_w, o_w, router_w, experts, norms = slots or (None,) * 5
        if router_w is None or experts is None:
            return None, "a layer without routed experts on the CPU, or weights the one-layer call does not take"
        per_layer.append((norms, qkv_w, o_w, lw.q_norm, lw.k_norm, router_w, experts))
    per_layer = _qkv_as_parts(per_layer)
    if len({typeof(t) for t in per_layer}) != 1:
        return None, "the layers' weights differ in kind"
    return tuple(per_layer), None


def _qkv_as_parts(per_layer):
    """Where some layers' qkv is two quantized parts and others' one quantized array, the one
    array as two parts too, split where the others split (their q|k rows, then v); else as given
    (an interleaved array too: its rows are groups of 16; the step then runs a call a layer)."""
    pairs = {t[1][0].shape[0] for t in per_layer if t[1][0] is not None and t[1][3] is not None}
    if len(pairs) != 1:
        return per_layer
    m0 = pairs.pop()
    out = []
    for t in per_layer:
        q0, c0, i0, q1, _, _, rows, plain = t[1]
        if q0 is not None and q1 is None and rows is None and plain is None and q0.shape[0] > m0 and c0 != X16:
            t = (t[0], (q0[:m0], c0, i0, q0[m0:], c0, i0, None, None)) + t[2:]
        out.append(t)
    return out
