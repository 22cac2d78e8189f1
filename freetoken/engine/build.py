"""What EngineCore builds from a loaded model: device weights, the KV pool, the recurrent-state
pool of a hybrid model, and the model object (through the architecture registry).

Shape legend: La full-attention layers (all layers of a Qwen3-MoE), G kv heads, D head dim.
"""
from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from freetoken.engine.kv_pool import KVPool
from freetoken.log import logger

KV_DEFAULT_BUDGET_BYTES = 1 << 30   # default KV pool cap when --num-kv-tokens is not given


def place_weights(ops, weights):
    """Non-expert weights go to the backend's device; routed experts stay in host memory (the
    MoE runtime decides where they run). A no-op on the numpy backends."""
    if ops.name != "cuda":
        return weights
    dev = ops.to_device
    embed = dev(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else dev(weights.lm_head)
    return replace(weights, embed=embed, final_norm=dev(weights.final_norm), lm_head=lm_head,
                   layers=tuple(placed(lw, dev) for lw in weights.layers))


def placed(lw, dev):
    """The layer with every array moved by ``dev`` except the routed expert banks, which stay in
    host memory for the MoE runtime (a dense layer's one-expert bank moves: it always runs)."""
    keep = {"gate_up", "down"} if lw.router is not None else set()
    return replace(lw, **{f.name: dev(getattr(lw, f.name)) for f in fields(lw)
                          if f.name not in keep and getattr(lw, f.name) is not None})


def kv_dtype(config, weights):
    kind = config.kv_dtype
    if kind == "auto":
        kind = "float32" if weights.embed.dtype == np.float32 else "bfloat16"
    return np.float32 if kind == "float32" else np.uint16


def make_kv_pool(cfg, config, weights, max_model_len: int, xp) -> KVPool:
    """One KV array per full-attention layer (GDN layers keep no KV), sized from the flag or
    running requests x context, capped at KV_DEFAULT_BUDGET_BYTES."""
    dtype = kv_dtype(config, weights)
    layers = len(cfg.attention_layers)
    per_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(dtype).itemsize
    tokens = config.num_kv_tokens
    if tokens <= 0:
        want = config.max_running_requests * max_model_len
        tokens = max(min(want, KV_DEFAULT_BUDGET_BYTES // per_token), 1)
        logger.info("KV pool: %d tokens (%s, %.1f MiB; %d running x %d context, capped at %d MiB)",
                    tokens, np.dtype(dtype).name if dtype != np.uint16 else "bf16",
                    tokens * per_token / 2**20, config.max_running_requests, max_model_len,
                    KV_DEFAULT_BUDGET_BYTES >> 20)
    return KVPool(layers, tokens, cfg.num_kv_heads, cfg.head_dim, dtype, xp)


def make_states(cfg, config, xp):
    """The hybrid model's recurrent-state pool (one row per running request), or None."""
    if not cfg.has_gdn:
        return None
    from freetoken.engine.state_pool import StatePool
    rows = config.max_running_requests
    states = StatePool.for_model(cfg, rows, xp)
    logger.info("recurrent-state pool: %d rows x %d GDN layers (%.1f MiB a request, %.1f MiB in all, fp32)",
                rows, len(cfg.linear_layers), StatePool.bytes_per_row(cfg) / 2**20, states.bytes / 2**20)
    return states


def make_model(cfg, weights, ops, moe, kv, states):
    from freetoken.models.registry import model_class
    return model_class(cfg.architecture)(cfg, weights, ops, moe, kv, states)


def prefix_cache_for(cfg, config, ops, tokenizer, device_spare: int = 0):
    """(radix prefix cache or None, checkpoint pool or None, anchors or None). A hybrid reuses a
    cached prefix only where a recurrent-state checkpoint exists, so it gets a pool and anchors.
    device_spare: GPU bytes the memory plan left for checkpoints (0 on the CPU path)."""
    from freetoken.engine.radix import RadixCache
    if not config.enable_prefix_cache:
        return None, None, None
    if not cfg.has_gdn:
        return RadixCache(), None, None
    host, device, why = checkpoint_budgets(cfg, config, device_spare)
    if host + device <= 0:
        logger.info("prefix cache off: a hybrid (Gated DeltaNet) model reuses a cached prefix only with a "
                    "recurrent-state checkpoint, and --state-checkpoint-mb is 0")
        return None, None, None
    from freetoken.engine.anchors import Anchors
    from freetoken.engine.checkpoints import CheckpointPool
    pool = CheckpointPool(host, device, ops)
    anchors = Anchors.for_tokenizer(tokenizer, config.semantic_anchors, config.state_checkpoint_interval)
    logger.info("state checkpoints: %s; at %d anchor markers%s", why, anchors.markers,
                f" and every {anchors.interval} prompt tokens" if anchors.interval else "")
    return RadixCache(pool), pool, anchors


CHECKPOINTS_PER_REQUEST = 32   # default host budget per running request (bench/agent_edits.py --budgets)
HOST_SHARE = 0.125             # the default takes at most this share of the host memory available


def checkpoint_budgets(cfg, config, device_spare: int) -> tuple[int, int, str]:
    """(host bytes, device bytes, a sentence saying how they were chosen) for the checkpoint pool.
    Host: --state-checkpoint-mb, else CHECKPOINTS_PER_REQUEST per running request, capped at
    HOST_SHARE of the memory available now (the weights are loaded). Device: --state-checkpoint-
    gpu-mb (the plan claimed it), else the plan's spare memory, at most the host tier's size."""
    from freetoken.engine.state_pool import StatePool
    from freetoken.env import available_memory_bytes
    row, mib = StatePool.bytes_per_row(cfg), lambda n: f"{n / 2**20:.0f} MiB"
    if config.state_checkpoint_mb >= 0:
        host, why = config.state_checkpoint_mb << 20, "--state-checkpoint-mb"
    else:
        want, avail = CHECKPOINTS_PER_REQUEST * config.max_running_requests * row, available_memory_bytes()
        host = max(min(want, int(HOST_SHARE * avail)), row) if avail else want
        why = (f"{CHECKPOINTS_PER_REQUEST} per running request x {config.max_running_requests}"
               + (f", capped at 1/{round(1 / HOST_SHARE)} of {avail / 2**30:.1f} GiB available" if host < want else ""))
    if config.state_checkpoint_gpu_mb >= 0:
        device = (config.state_checkpoint_gpu_mb << 20) if device_spare else 0
    else:
        device = min(device_spare, host)
    text = f"host {mib(host)} ({host // row} of {row / 2**20:.1f} MiB; {why})"
    if device_spare or config.state_checkpoint_gpu_mb > 0:
        text = f"device {mib(device)} ({device // row}; memory the plan left after the expert cache), " + text
    return host, device, text
