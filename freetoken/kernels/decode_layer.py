"""The attention half of a Qwen3-MoE layer at a decode step, in one numba call (cpu backend):
input RMSNorm, q/k/v, the per-head q/k norms, RoPE, the KV write, decode attention, o_proj, the
residual add, the post-attention RMSNorm, and the router (its linear and top-k) on that norm.
Spec: the same composition of ops (Qwen3Moe's attention and router, models/qwen3_moe.py); this calls the very kernels the cpu ops call, in the same order
on the same arrays, so its result is the composition's bit for bit
(tests/kernels/test_decode_layer.py).

Why: at batch 1 each op is a numba call plus its Python wrapper, ~15 of them a layer; on the
2-core Zen 4 VM a step of synth:tiny,layers=12 (ops of no size) took 1.3 ms, a fifth of a
Q4_K_M medium step (docs/performance.md, "where the decode-at-64 gap is"). One call a layer keeps
the kernels and drops the Python between them. At one token a step the layer's routed experts
join the call too (``_layer``) when the MoE runtime's cpu backend hands over their host bank.

Taken only where the cpu ops would run these kernels: a decode step (no sequence computes more
than one token) of fewer than FUSED_MAX_T tokens, so every linear is a row GEMV (not BLAS or the
tile GEMM), with q/k/v either one array or two quantized parts (a GGUF q|k and v). Anything else
returns None and the model composes the ops.

Shape legend: T step tokens, H hidden, Hq/G query/kv heads, D head dim, N KV slots, B sequences,
C positions a sequence row.
"""
import weakref

import numpy as np

from freetoken.kernels import linear as _linear_op
from freetoken.kernels import linear_quant
from freetoken.kernels.linear_quant import _gemv as _qgemv, _gemv_pair as _qgemv_pair
from freetoken.kernels._blas_pool import workers
from freetoken.kernels._numba import SERIAL, njit, weight_rows
from freetoken.kernels.attention_decode import chunking, merge, partials
from freetoken.kernels.attention import _first_bad_sequence
from freetoken.kernels.experts import _plan
from freetoken.kernels.experts_pairs import _pairs_gemv
from freetoken.kernels.experts_quant import _decode as _experts_decode
from freetoken.kernels.kv_write import _write
from freetoken.kernels.linear import _gemv, _gemv_pairs, split_pairs
from freetoken.kernels.qact import wants_int8
from freetoken.kernels.qformats import format_of, is_quantized
from freetoken.kernels.rms_norm import _rms_norm
from freetoken.kernels.rope import _rope_few
from freetoken.kernels.router import _route

FUSED_MAX_T = min(linear_quant.GEMM_MIN_T, _linear_op.BLAS_MIN_T)   # tokens below which linears are GEMVs
OK, BAD_KV_SLOT, BAD_TOKEN, BAD_SEQUENCE = 0, 1, 2, 3                 # the kernel's status


@njit(**SERIAL)
def _gemv_into(x, q0, c0, i0, q1, c1, i1, rows, plain, out):
    """linear.cpu's GEMV for few tokens. Of the weight slots the unused are None (numba drops the
    branches of a None argument): q0 alone a quantized array, q0 and q1 two quantized parts, rows
    bf16-pair rows u32[M,K/2], plain f32 or odd bf16 rows."""
    toks = np.arange(x.shape[0]).astype(np.int32)
    if q0 is not None:
        if q1 is not None:
            _qgemv_pair(x, q0, c0, i0, q1, c1, i1, out)
        else:
            _qgemv(x, q0, c0, i0, out)
    if rows is not None:
        _gemv_pairs(split_pairs(x), rows, toks, out)
    if plain is not None:
        _gemv(x.reshape(x.shape[0], 1, x.shape[1]), plain, toks, out)


@njit(**SERIAL)
def _linear_into(x, w, out):
    """_gemv_into with the slots as one tuple w (weight_slots): (q0, code0, int8_0, q1, code1,
    int8_1, rows, plain)."""
    _gemv_into(x, w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], out)


@njit(**SERIAL)
def _heads(qkv, q_norm, k_norm, eps, positions, inv_freq, Hq, G, D):
    """q f32[T,Hq,D], k, v f32[T,G,D] of qkv f32[T,(Hq+2G)*D]: q and k normed per head and
    rotated (Qwen3Moe._head_norm, then rope), v as it is."""
    T = qkv.shape[0]
    q = np.ascontiguousarray(qkv[:, :Hq * D]).reshape(T * Hq, D)
    k = np.ascontiguousarray(qkv[:, Hq * D:(Hq + G) * D]).reshape(T * G, D)
    v = np.ascontiguousarray(qkv[:, (Hq + G) * D:]).reshape(T, G, D)
    qn, kn = np.empty_like(q), np.empty_like(k)
    _rms_norm(q, q_norm, eps, qn)
    _rms_norm(k, k_norm, eps, kn)
    qr, kr = np.empty((T, Hq, D), np.float32), np.empty((T, G, D), np.float32)
    _rope_few(qn.reshape(T, Hq, D), positions, inv_freq, qr)
    _rope_few(kn.reshape(T, G, D), positions, inv_freq, kr)
    return qr, kr, v


@njit(**SERIAL)
def _attend(h, qkv_w, q_norm, k_norm, eps, dims, positions, inv_freq, k_cache, v_cache, slots, slot_table,
            tok_seq, scale, chunks):
    """(a f32[T,Hq*D], bad): attention over the KV cache of the normed h, its k and v written
    first; bad is the KV write's first bad slot (-1: none; then nothing was written)."""
    Hq, G, D = dims
    T = h.shape[0]
    qkv = np.empty((T, (Hq + 2 * G) * D), np.float32)
    _linear_into(h, qkv_w, qkv)
    q, k, v = _heads(qkv, q_norm, k_norm, eps, positions, inv_freq, Hq, G, D)
    a = np.empty((T, Hq, D), np.float32)
    bad = _write(k, v, k_cache, v_cache, slots)
    if bad < 0:
        CH, nch = chunks
        acc = np.empty((T, nch, G, Hq // G, D), np.float32)
        ml = np.empty((T, nch, G, Hq // G, 2), np.float32)
        partials(q, k_cache, v_cache, slot_table, tok_seq, positions, scale, CH, acc, ml)
        merge(acc, ml, a)
    return a.reshape(T, Hq * D), bad


@njit(**SERIAL)
def _attention_half(x, norms, eps, qkv_w, o_w, q_norm, k_norm, dims, positions, inv_freq, k_cache, v_cache,
                    slots, slot_table, tok_seq, scale, chunks, h_out, router_w, norm_topk, logits, ids, weights):
    """x f32[T,H] += o_proj(attention(...)); h_out = post-norm of the sum; with router_w (None
    for a layer whose routing is composed) its logits f32[T,E] and the route into ids, weights
    [T,k]. norms: (input, post); dims (Hq, G, D); chunks (CH, nch) of attention_decode.chunking.
    Returns (status, index): OK, or where the step is bad (nothing written to x then)."""
    seq = _first_bad_sequence(slot_table, tok_seq, positions, k_cache.shape[0])
    if seq != -1:
        return (BAD_TOKEN, 0) if seq == -2 else (BAD_SEQUENCE, seq)
    h = np.empty_like(x)
    _rms_norm(x, norms[0], eps, h)
    a, bad = _attend(h, qkv_w, q_norm, k_norm, eps, dims, positions, inv_freq, k_cache, v_cache, slots,
                     slot_table, tok_seq, scale, chunks)
    if bad >= 0:
        return BAD_KV_SLOT, bad
    o = np.empty_like(x)
    _linear_into(a, o_w, o)
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] = x[t, i] + o[t, i]
    _rms_norm(x, norms[1], eps, h_out)
    if router_w is not None:
        _linear_into(h_out, router_w, logits)
        _route(logits, ids.shape[1], norm_topk, ids, weights)
    return OK, 0


@njit(**SERIAL)
def _layer(x, norms, eps, qkv_w, o_w, q_norm, k_norm, dims, positions, inv_freq, k_cache, v_cache,
           slots, slot_table, tok_seq, scale, chunks, h_out, router_w, norm_topk, logits, ids, weights, bank):
    """_attention_half, then the routed experts of its route on h_out added into x, as the MoE
    runtime's cpu backend runs them (experts.cpu at a decode step: _plan, then experts_quant's
    _decode on a quantized host bank, experts_pairs._pairs_gemv on bf16-pair rows): bank = (quantized
    gate_up, down, format codes, int8 flags, bf16-pair gate_up, down, bf16 rounding), the slots
    of the kind not given None."""
    status = _attention_half(x, norms, eps, qkv_w, o_w, q_norm, k_norm, dims, positions, inv_freq, k_cache,
                             v_cache, slots, slot_table, tok_seq, scale, chunks, h_out, router_w, norm_topk,
                             logits, ids, weights)
    if status[0] == OK:
        y = _experts_into(h_out, ids, weights, bank[0], bank[1], bank[2], bank[3], bank[4], bank[5], bank[6])
        for t in range(x.shape[0]):
            for i in range(x.shape[1]):
                x[t, i] = x[t, i] + y[t, i]
    return status


@njit(**SERIAL)
def _experts_into(h, ids, weights, gate_up, down, codes, int8s, rows_gu, rows_dn, rnd):
    """_layer's experts on h f32[T,H]; the bank's unused slots are None (numba drops the branches
    of a None argument, as in _gemv_into)."""
    y = np.empty_like(h)
    if gate_up is not None:
        uniq, offs, ptok, pw = _plan(ids, weights, gate_up.shape[0])
        _experts_decode(h, gate_up, down, codes, int8s, uniq, offs, ptok, pw, y)
    if rows_gu is not None:
        uniq, offs, ptok, pw = _plan(ids, weights, rows_gu.shape[0])
        _pairs_gemv(h, rows_gu, rows_dn, rnd, uniq, offs, ptok, pw, y)
    return y


# ---- the Python side: what the kernel is given, once a step and once a weight -----------------

_last_step: list = [(None, 0, None)]    # (the last step's batch, its thread count, its arrays): one
                                        # tuple, read and replaced whole (a step runs on one thread)


def weight_slots(w, dots):
    """_linear_into's slots for weight w (an array, or a tuple of parts) under ``dots``, or None
    when the cpu ops would not run it as one row GEMV call."""
    kind = _kind_of(w, dots)
    if kind is None or (kind[0] == "pair") != isinstance(w, tuple):
        return None
    if kind[0] == "pair":
        return (np.ascontiguousarray(w[0]), kind[1], kind[2], np.ascontiguousarray(w[1]), kind[3], kind[4],
                None, None)
    if kind[0] == "blocks":
        return np.ascontiguousarray(w), kind[1], kind[2], None, 0, False, None, None
    rows = weight_rows(np.ascontiguousarray(w))
    return (None, 0, False, None, 0, False) + ((rows, None) if rows.dtype == np.uint32 else (None, rows))


def _kind_of(w, dots):
    """("pair", code0, int8_0, code1, int8_1) | ("blocks", code, int8) | ("dense",) | None."""
    if isinstance(w, tuple):
        if len(w) != 2 or not all(map(is_quantized, w)):
            return None
        return ("pair", format_of(w[0]).code, wants_int8(w[0], dots), format_of(w[1]).code, wants_int8(w[1], dots))
    if is_quantized(w):
        return "blocks", format_of(w).code, wants_int8(w, dots)
    return ("dense",)


def bank_slots(bank, dots):
    """_layer's bank for a host bank (gate_up, down) under ``dots``, or None when experts.cpu
    would not run it at one token as experts_quant's _decode (quantized) or _pairs_gemv (bf16
    rows read as pairs; --cpu-dots int8 rounds to bf16 before each bank, experts_bf16.wants_bf16)."""
    kind = _bank_kind(bank, dots)
    if kind == "pairs":
        return None, None, (0, 0), (False, False), weight_rows(bank[0]), weight_rows(bank[1]), dots == "int8"
    return None if kind is None else (np.ascontiguousarray(bank[0]), np.ascontiguousarray(bank[1]), *kind,
                                      None, None, False)


def _bank_kind(bank, dots):
    if all(map(is_quantized, bank)):
        return tuple(format_of(w).code for w in bank), tuple(wants_int8(w, dots) for w in bank)
    return "pairs" if all(weight_rows(w).dtype == np.uint32 for w in bank) else None


def step_arrays(batch):
    """(positions, slots, slot_table, tok_seq, chunks) of a decode step at the calling thread's
    compute threads, made once a step (every layer reads the same; asking numba for the thread
    count was 1.8% of a Q4_K_M medium decode step, once a layer)."""
    seen_batch, _, seen = _last_step[0]
    if seen_batch is batch:
        return seen
    threads = workers()
    positions = np.ascontiguousarray(batch.positions, np.int32)
    chunks = chunking(positions.shape[0], int(positions.max()) + 1, threads)
    arrays = (positions, np.ascontiguousarray(batch.slots, np.int32),
              np.ascontiguousarray(batch.slot_table, np.int32), np.ascontiguousarray(batch.tok_seq, np.int32),
              chunks)
    _last_step[0] = (batch, threads, arrays)
    return arrays


def cpu(x, lw, k_cache, v_cache, batch, inv_freq, eps, scale, dims, route=None, bank=None, *, dots="f32"):
    """The attention half of layer weights lw at decode step `batch`: x f32[T,H] gets the
    attention output added in place; returns (h, routing, experts_added): h = rms_norm(x,
    lw.post_norm), routing (ids int32[T,k], weights f32[T,k]) of lw.router for route = (k,
    norm_topk_prob), or None (no route asked, a dense layer). With bank, the layer's host experts
    (gate_up, down) that the MoE runtime would run on the CPU, a one-token step whose bank is
    quantized or bf16 pairs also gets its routed experts added into x in the same call (experts_added True;
    why: the Python between the two calls was ~5% of a Q4_K_M medium decode step, Zen 4 VM). None
    instead when the step or the weights are not this kernel's (see the module doc) and the
    caller composes the ops."""
    T = x.shape[0]
    if (batch.prefill or T == 0 or T >= FUSED_MAX_T or k_cache.dtype != v_cache.dtype
            or x.dtype != np.float32 or not x.flags.c_contiguous):
        return None
    layer = layer_slots(lw, dots, route is not None, bank)
    if layer is None:
        return None
    qkv_w, o_w, router_w, experts, norms = layer
    routing = (None, None, None) if router_w is None else (
        np.empty((T, lw.router.shape[0]), np.float32), np.empty((T, route[0]), np.int32),
        np.empty((T, route[0]), np.float32))
    positions, slots, slot_table, tok_seq, chunks = step_arrays(batch)
    h = np.empty_like(x)
    experts = experts if T == 1 else None
    args = (x, norms, np.float32(eps), qkv_w, o_w, lw.q_norm, lw.k_norm, dims,
            positions, inv_freq, k_cache, v_cache, slots, slot_table, tok_seq, np.float32(scale), chunks, h,
            router_w, bool(route[1]) if route else False, *routing)
    status, where = _attention_half(*args) if experts is None else _layer(*args, experts)
    _raise_for(status, where, slots, k_cache.shape[0])
    return h, (None if router_w is None else routing[1:]), experts is not None


_layers: dict = {}          # id(lw) -> (its weakref, dots, routed, the bank's first array or None, slots)


def layer_slots(lw, dots, routed, bank):
    """(qkv_w, o_w, router_w, experts, norms) of layer weights lw for the kernels, or None when
    they are not this kernel's: the slots of weight_slots and bank_slots (experts None without a
    bank, a route or a bank of this kernel's kinds), kept per layer while lw lives. Why: building
    them each call was ~8 us a layer, cold-cache Python between two 400-us kernels (Q4_0 medium,
    Zen 4 VM)."""
    first = None if bank is None else bank[0]
    hit = _layers.get(id(lw))
    if hit is None or hit[0]() is not lw or hit[1] != dots or hit[2] != routed or hit[3] is not first:
        hit = (weakref.ref(lw, lambda _, k=id(lw): _layers.pop(k, None)), dots, routed, first,
               _build_slots(lw, dots, routed, bank))
        _layers[id(lw)] = hit
    return hit[4]


def _build_slots(lw, dots, routed, bank):
    qkv_w, o_w = weight_slots(lw.qkv, dots), weight_slots(lw.o_proj, dots)
    if qkv_w is None or o_w is None:
        return None
    router_w = None if not routed or lw.router is None else weight_slots(lw.router, dots)
    experts = None if bank is None or router_w is None else bank_slots(bank, dots)
    return qkv_w, o_w, router_w, experts, (lw.input_norm, lw.post_norm)


def _raise_for(status, where, slots, n_slots):
    """The errors the composed ops raise for the same bad step."""
    if status == BAD_TOKEN:
        raise IndexError("attention: tok_seq or tok_pos outside slot_table")
    if status == BAD_SEQUENCE:
        raise IndexError(f"attention: sequence {where} reads a slot outside [0, {n_slots})")
    if status == BAD_KV_SLOT:
        raise IndexError(f"kv_write: slot {int(slots[where])} out of range [0, {n_slots})")
