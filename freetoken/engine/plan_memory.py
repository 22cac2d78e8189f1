"""The plan's memory arithmetic: how the GPU memory FreeToken may use splits into non-expert weights,
workspace, per-request states, KV cache and what is left for the expert cache (docs/design.md, Memory:
one expert cache for all layers), and the KV pool's size on the host.

Pure arithmetic on the model shape, the flags and measured numbers; engine/plan.py decides with it.
``--gpu-memory-gb X`` caps the budget. Claims, in order: non-expert weights (must fit); workspace
(activations and op scratch of the largest step); per-request states (a GDN model's recurrent
states, a sliding-window model's rings); KV (running x context, at most KV_MAX_SHARE of what is
left, but always one full context); state checkpoints when --state-checkpoint-gpu-mb asks for
some; every remaining byte is room for expert-cache slots.

Shape legend: L layers, Lm MoE layers, E experts, k routed, H hidden, I expert width, V vocab,
Hq/G query/kv heads, D head dim, T tokens of the largest step.
"""
from __future__ import annotations

from dataclasses import dataclass

from freetoken.config import ConfigError, EngineConfig, ModelConfig

GB = 1e9                  # --gpu-memory-gb counts decimal gigabytes, as GPU vendors do
RESERVE = 0.02            # of free memory: allocator fragmentation, CUDA context growth
KV_MAX_SHARE = 0.25       # auto-sized KV takes at most this share of what weights+workspace leave
MIN_WORKSPACE = 256 << 20
ACT_COPIES = 2            # live activation temporaries overlap within a layer (x, residual, outputs)
HOST_KV_BUDGET = 1 << 30  # an auto-sized KV pool in host memory takes at most this many bytes


@dataclass(frozen=True)
class GpuMemory:
    """The GPU budget split into its claims; expert_room_bytes is what the expert cache may use."""

    budget_bytes: int
    capped_by: str            # "--gpu-memory-gb" or "free memory"
    weights_bytes: int        # non-expert weights (and dense-MLP layers), always resident
    workspace_bytes: int      # activations, op scratch, graph logits of the largest step
    state_bytes: int          # the per-request state pool (GDN states, sliding windows' rings)
    kv_tokens: int
    kv_bytes: int
    checkpoint_claim_bytes: int   # --state-checkpoint-gpu-mb N, claimed before the expert cache
    expert_room_bytes: int
    one_expert_bytes: int     # gate_up + down of one expert
    total_experts: int        # Lm * E

    @property
    def fit_slots(self) -> int:
        """Expert slots the room holds, at most every expert."""
        if not self.one_expert_bytes:
            return self.total_experts
        return min(self.total_experts, max(self.expert_room_bytes, 0) // self.one_expert_bytes)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Everything but the routed experts: embeddings, lm_head, attention, norms, routers, dense MLPs
    (a GDN model's: its GDN layers and shared experts too)."""
    if cfg.has_gdn:
        from freetoken.models.gdn_weights import gdn_param_count
        routed = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return (gdn_param_count(cfg) - routed) * dtype_bytes
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + H
    for layer in range(cfg.num_layers):
        n += (Hq + 2 * G) * D * H + H * Hq * D + 2 * H + 2 * D
        n += cfg.num_experts * H if cfg.is_moe_layer(layer) else 3 * H * cfg.intermediate_size
    return n * dtype_bytes


def expert_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """One expert: gate_up [2I, H] + down [H, I]."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig, kv_itemsize: int) -> int:
    return 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * kv_itemsize


def state_pool_class(cfg: ModelConfig):
    """The one choice of a model's per-request state pool: a GDN model's fp32 recurrent states
    (engine/state_pool.py), a sliding-window model's rings (engine/window_pool.py), or None. The
    plan sizes it and engine/build.py builds it from this answer."""
    if cfg.has_gdn:
        from freetoken.engine.state_pool import StatePool
        return StatePool
    if cfg.sliding_kv:
        from freetoken.engine.window_pool import WindowPool
        return WindowPool
    return None


def state_bytes(cfg: ModelConfig, running: int, chunk: int, kv_itemsize: int) -> int:
    """The per-request state pool, one row per running request."""
    pool = state_pool_class(cfg)
    return pool.bytes_per_row(cfg, chunk, kv_itemsize) * running if pool is not None else 0


def checkpoint_bytes(cfg: ModelConfig, kv_itemsize: int) -> int:
    """One state checkpoint (engine/checkpoints.py): a GDN state row, or W positions of every
    sliding layer's KV."""
    return state_pool_class(cfg).checkpoint_bytes(cfg, kv_itemsize)


def workspace_bytes(cfg: ModelConfig, ec: EngineConfig, context: int) -> int:
    """Activations of the largest step plus the gpu ops' scratch (kernels/experts.py and
    kernels/attention.py scratch_bytes, the exact layouts) plus every decode graph's logits."""
    from freetoken.kernels import attention, experts
    H, D, Hq, G, k = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts_per_tok
    B = ec.max_running_requests
    T = max(ec.chunked_prefill_size, B)
    per_token = 6 * H + 2 * (Hq + 2 * G) * D + 2 * Hq * D + cfg.num_experts + 2 * k
    acts = ACT_COPIES * 4 * T * per_token
    moe = experts.scratch_bytes(T, k, H, cfg.moe_intermediate_size, cfg.num_experts)
    nch = -(-context // attention._decode_chunk(B, G, context, Hq // G, D))
    decode = attention.scratch_bytes(B, Hq, D, nch)
    logits = 4 * cfg.vocab_size * B * (B + 1) // 2 + 4 * cfg.vocab_size * B
    # the scratch pool is grow-only in powers of two: up to twice the largest request
    return max(MIN_WORKSPACE, acts + 2 * max(moe, decode) + logits)


def host_kv_tokens(asked: int | None, running: int, context: int, per_token: int) -> tuple[int, str]:
    """(tokens, why) of a KV pool in host memory: as asked, else running x context capped at
    HOST_KV_BUDGET."""
    if asked is not None:
        return asked, "--num-kv-tokens"
    want = running * context
    tokens = max(min(want, HOST_KV_BUDGET // per_token), 1)
    why = f"{running} running x {context} context" + (
        f", capped at {HOST_KV_BUDGET >> 20} MiB" if tokens < want else "")
    return tokens, why


def gpu_kv_tokens(asked: int | None, running: int, context: int, per_token: int, left: int) -> tuple[int, str]:
    """(tokens, why) of a KV pool on the GPU: as asked, else running x context, at most KV_MAX_SHARE
    of what weights and workspace leave, but always one full context. Raises when it does not fit."""
    if asked is not None:
        tokens, why = asked, "--num-kv-tokens"
    else:
        want = running * context
        tokens = max(min(want, int(KV_MAX_SHARE * left) // per_token), min(want, context))
        why = f"{running} running x {context} context" + (
            f", at most {KV_MAX_SHARE:.0%} of the memory left" if tokens < want else "")
    if tokens * per_token > left:
        raise ConfigError(f"--num-kv-tokens: a KV cache of {tokens} tokens needs {tokens * per_token / GB:.2f} GB; "
                          f"{max(left, 0) / GB:.2f} GB are left after weights and workspace")
    return tokens, why


def split_gpu_memory(cfg: ModelConfig, ec: EngineConfig, free_bytes: int, dtype_bytes: int, kv_itemsize: int,
                     context: int, kv_asked: int | None, stored: tuple[int, int] | None = None
                     ) -> tuple[GpuMemory, str]:
    """(the split of min(free memory less RESERVE, --gpu-memory-gb), why the KV pool has its size).
    stored: (non-expert weight bytes, one expert slot's bytes) as loaded, when the weights are not
    dtype_bytes per parameter (quantized blocks). Raises ConfigError naming the claim that does not fit."""
    usable = int(free_bytes * (1 - RESERVE))
    cap = int((ec.gpu_memory_gb or 0) * GB)
    budget, capped_by = (cap, "--gpu-memory-gb") if 0 < cap < usable else (usable, "free memory")
    weights = stored[0] if stored else weight_bytes(cfg, dtype_bytes)
    work = workspace_bytes(cfg, ec, context)
    states = state_bytes(cfg, ec.max_running_requests, ec.chunked_prefill_size, kv_itemsize)
    left = budget - weights - work - states
    if left <= 0:
        raise ConfigError(f"weights ({weights / GB:.2f} GB), workspace ({work / GB:.2f} GB) and per-request "
                          f"states ({states / GB:.2f} GB) exceed the GPU budget of {budget / GB:.2f} GB ({capped_by})")
    per_token = kv_bytes_per_token(cfg, kv_itemsize)
    kv_tokens, kv_why = gpu_kv_tokens(kv_asked, ec.max_running_requests, context, per_token, left)
    kv = kv_tokens * per_token
    claim = (ec.state_checkpoint_gpu_mb or 0) << 20 if cfg.keeps_request_state else 0
    if claim > left - kv:
        raise ConfigError(f"--state-checkpoint-gpu-mb {ec.state_checkpoint_gpu_mb} does not fit: "
                          f"{max(left - kv, 0) / GB:.2f} GB are left after weights, workspace and KV")
    memory = GpuMemory(budget, capped_by, weights, work, states, kv_tokens, kv, claim, left - kv - claim,
                       stored[1] if stored else expert_bytes(cfg, dtype_bytes),
                       len(cfg.moe_layers) * cfg.num_experts)
    return memory, kv_why
