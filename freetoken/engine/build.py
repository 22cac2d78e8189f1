"""What EngineCore builds from a loaded model and its plan (engine/plan.py): device weights, the KV
pool, the per-request state pool (GDN states, sliding windows' rings) and checkpoint pool, the
prefix cache, the Scheduler's recurrent-state seam, and the model object (through the
architecture registry). Builds; never decides, but for one thing the CPU itself settles: whether
the cpu backend's q4_0 matrices are interleaved (``interleaved_q4_0``, logged).

Shape legend: La full-attention layers (all layers of a Qwen3-MoE), G kv heads, D head dim.
"""
from __future__ import annotations

import time
from dataclasses import fields, replace

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.plan import kv_array_dtype
from freetoken.engine.plan_memory import state_pool_class
from freetoken.engine.state_pool import StatePool
from freetoken.log import logger


def prepare_host(ops, config, cfg) -> None:
    """The host side's one-time settings, each logged: which CPU kernels run (every backend but ref
    runs numba kernels: the MoE's CPU branch; the cpu backend's decode attention for this model's
    heads) and glibc malloc's reuse of freed scratch."""
    if ops.name != "ref":
        from freetoken.kernels._isa import describe
        logger.info("cpu kernels: %s; quantized weights dotted in %s (--cpu-dots)", describe(), config.cpu_dots)
    if ops.name == "cpu":
        from freetoken.kernels.attention_decode import describe as attention_path
        logger.info("%s", attention_path(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim))
    if config.host_scratch_reuse:
        from freetoken.engine.host_malloc import reuse_freed_scratch
        reuse_freed_scratch(logger)


def place_weights(ops, weights, config=None):
    """Non-expert weights go to the backend's device; routed experts stay in host memory (the
    MoE runtime decides where they run). The cpu backend keeps them in place, its q4_0 matrices
    interleaved for its kernels when ``config`` asks (interleaved_q4_0)."""
    if ops.name == "cpu" and config is not None and config.cpu_interleave_q4_0:
        return interleaved_q4_0(weights, config.cpu_dots)
    if ops.name != "cuda":
        return weights
    dev = _dense_to(ops.to_device)
    embed = dev(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else dev(weights.lm_head)
    return replace(weights, embed=embed, final_norm=dev(weights.final_norm), lm_head=lm_head,
                   layers=tuple(placed(lw, dev) for lw in weights.layers))


def interleaved_q4_0(weights, dots):
    """weights with their q4_0 matrices rewritten in place as kernels/qinterleave.py's 16-row
    groups, when the cpu kernels read that layout here: int8 dots and the int8 tile GEMM on VNNI
    (qgemm.fast_here; elsewhere prefill dequantizes rows for BLAS, which takes the file's layout).
    Which: each MoE layer's expert banks, and the attention's qkv and o_proj when every layer's
    can be (a layer whose qkv is two parts keeps the others' one array splittable at any row:
    decode_stack._qkv_as_parts). Logged either way when there is a q4_0 one."""
    from freetoken.kernels import qgemm
    from freetoken.kernels.qinterleave import can_interleave, interleave
    names = [_interleavable(lw, can_interleave) for lw in weights.layers]
    dense = all({"qkv", "o_proj"} <= set(n) for n in names)
    names = [[f for f in n if dense or f in ("gate_up", "down")] for n in names]
    count = sum(map(len, names))
    if not count:
        return weights
    if dots != "int8" or not qgemm.fast_here():
        why = "--cpu-dots f32" if dots != "int8" else "no VNNI here: prefill dequantizes the rows for BLAS"
        logger.info("cpu weights: q4_0 kept in the file's layout (%s)", why)
        return weights
    start = time.perf_counter()
    layers = tuple(replace(lw, **{f: interleave(getattr(lw, f)) for f in n}) for lw, n in zip(weights.layers, names))
    logger.info("cpu weights: %d q4_0 matrices (%s) interleaved 16 rows at a time, in place, in %.2f s (decode dots "
                "16 rows a step; --no-cpu-interleave-q4-0 keeps the file's layout)", count,
                "expert banks, qkv, o_proj" if dense else "expert banks", time.perf_counter() - start)
    return replace(weights, layers=layers)


def _interleavable(lw, can_interleave) -> list[str]:
    """The fields of layer lw that could be interleaved: its routed expert banks, qkv, o_proj."""
    fields_ = ("gate_up", "down") if lw.router is not None else ()
    return [f for f in fields_ + ("qkv", "o_proj") if can_interleave(getattr(lw, f, None))]


def _dense_to(to_device):
    """to_device of a weight; a quantized one keeps its blocks (the CUDA linear and embedding ops
    read them: cuda/linear_quant.cu, qblocks.cu) and a tuple of parts (q/k/v of two formats) moves
    part by part."""
    def move(a):
        return tuple(move(p) for p in a) if isinstance(a, tuple) else to_device(a)

    return move


def device_fields(lw) -> list[str]:
    """The layer's weights that live on the device: all but the routed expert banks, which stay in
    host memory for the MoE runtime (a dense layer's one-expert bank moves: it always runs)."""
    keep = {"gate_up", "down"} if lw.router is not None else set()
    return [f.name for f in fields(lw) if f.name not in keep and getattr(lw, f.name) is not None]


def placed(lw, dev):
    """The layer with its device_fields moved by ``dev``."""
    return replace(lw, **{name: dev(getattr(lw, name)) for name in device_fields(lw)})


def make_kv_pool(cfg, plan, xp) -> KVPool:
    """One KV array per full-attention layer (GDN layers keep no KV, sliding layers keep theirs per
    request: engine/window_pool.py), of the plan's size and dtype."""
    return KVPool(len(cfg.attention_layers), plan.kv_tokens, cfg.num_kv_heads, cfg.head_dim,
                  kv_array_dtype(plan.kv_dtype), xp)


def make_states(cfg, plan, xp, chunk: int):
    """The per-request state pool (one row per running request): a GDN model's recurrent states, a
    sliding-window model's rings of its sliding layers' KV (``chunk``: the prefill chunk, which
    sizes the ring); None for a model without."""
    pool = state_pool_class(cfg)
    if not plan.state_rows or pool is None:
        return None
    if pool is not StatePool:
        return _window_pool(pool, cfg, plan, xp, chunk)
    states = StatePool.for_model(cfg, plan.state_rows, xp)
    logger.info("recurrent-state pool: %d rows x %d GDN layers (%.1f MiB a request, %.1f MiB in all, fp32)",
                plan.state_rows, len(cfg.linear_layers), StatePool.bytes_per_row(cfg) / 2**20, states.bytes / 2**20)
    return states


def _window_pool(window_pool, cfg, plan, xp, chunk: int):
    pool = window_pool.for_model(cfg, plan.state_rows, chunk, kv_array_dtype(plan.kv_dtype), plan.context_len, xp)
    logger.info("sliding-window KV: %d rows x %d sliding layers, a ring of %d positions each (window %d + "
                "pieces of %d; %.1f MiB a request, %.1f MiB in all); the %d full layers keep theirs in the KV pool",
                plan.state_rows, len(cfg.sliding_layers), pool.ring, pool.window, pool.piece,
                pool.bytes / plan.state_rows / 2**20, pool.bytes / 2**20, len(cfg.attention_layers))
    return pool


def make_model(cfg, weights, ops, moe, kv, states):
    from freetoken.models.registry import model_class
    return model_class(cfg.architecture)(cfg, weights, ops, moe, kv, states)


def checkpoint_pool(plan, config, ops, tokenizer):
    """(the state checkpoint pool, its anchors), or (None, None), as the plan sized them."""
    if not plan.prefix_cache or plan.checkpoint_host_bytes + plan.checkpoint_device_bytes <= 0:
        return None, None
    from freetoken.engine.anchors import Anchors
    from freetoken.engine.checkpoints import CheckpointPool
    pool = CheckpointPool(plan.checkpoint_host_bytes, plan.checkpoint_device_bytes, ops)
    anchors = Anchors.for_tokenizer(tokenizer, config.semantic_anchors, config.state_checkpoint_interval)
    logger.info("state checkpoints at %d anchor markers%s", anchors.markers,
                f" and every {anchors.interval} prompt tokens" if anchors.interval else "")
    return pool, anchors


def prefix_cache(plan, pool):
    """The radix prefix cache (over the state checkpoint pool, if any), or None when the plan has none."""
    from freetoken.engine.radix import RadixCache
    return RadixCache(pool) if plan.prefix_cache else None


def recurrent_seam(states, cache, pool, anchors):
    """What the Scheduler calls for a request's recurrent state (engine/resume.py)."""
    from freetoken.engine.resume import NoRecurrentState, Resumer, StateRows
    if states is None:
        return NoRecurrentState()
    if cache is None or pool is None:
        return StateRows(states)
    return Resumer(cache, pool, states, anchors)
