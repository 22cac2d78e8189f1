"""GPU memory plan: how the memory FreeToken may use splits into non-expert weights, workspace,
KV cache and the expert cache (DESIGN §1: the memory left over is one expert cache for all layers).

Pure arithmetic on the model and engine configs, so it is tested on a CPU; the engine measures
free device memory (cudaMemGetInfo) and passes it in. ``--gpu-memory-gb X`` caps the budget.
Claims, in order: non-expert weights (must fit); workspace (activations and op scratch of the
largest step); a hybrid's recurrent states; KV (max_running x context, at most KV_MAX_SHARE of
what is left, but always one full context); state checkpoints when --state-checkpoint-gpu-mb
asks for some; then every remaining byte becomes expert-cache slots, capped at all Lm*E experts
(then the `fused` backend fits), and what even that leaves is a hybrid's checkpoint device tier.

Shape legend: L layers, Lm MoE layers, E experts, k routed, H hidden, I expert width, V vocab,
Hq/G query/kv heads, D head dim, T tokens of the largest step.
"""
from __future__ import annotations

from dataclasses import dataclass

from freetoken.config import ConfigError, EngineConfig, ModelConfig
from freetoken.moe.options import rate_slots

GB = 1e9                  # --gpu-memory-gb counts decimal gigabytes, as GPU vendors do
RESERVE = 0.02            # of free memory: allocator fragmentation, CUDA context growth
KV_MAX_SHARE = 0.25       # auto-sized KV takes at most this share of what weights+workspace leave
MIN_WORKSPACE = 256 << 20
ACT_COPIES = 2            # live activation temporaries overlap within a layer (x, residual, outputs)


@dataclass(frozen=True)
class GpuPlan:
    budget_bytes: int
    weights_bytes: int       # non-expert weights (and dense-MLP layers), always resident
    workspace_bytes: int     # activations, op scratch, graph logits of the largest step
    kv_bytes: int
    kv_tokens: int
    expert_slots: int
    expert_bytes: int        # expert_slots x bytes of one expert (gate_up + down)
    total_experts: int       # Lm * E
    capped_by: str           # "--gpu-memory-gb" or "free memory"
    state_bytes: int = 0     # a hybrid's recurrent-state pool (one fp32 row per running request)
    checkpoint_bytes: int = 0  # a hybrid's device tier of state checkpoints (engine/checkpoints.py)

    @property
    def fits_all_experts(self) -> bool:
        return self.expert_slots >= self.total_experts

    @property
    def expert_fraction(self) -> float:
        return self.expert_slots / self.total_experts if self.total_experts else 1.0

    def describe(self) -> str:
        gb = lambda n: f"{n / GB:.1f} GB"
        return (f"budget {gb(self.budget_bytes)}: weights {gb(self.weights_bytes)}, "
                f"KV {gb(self.kv_bytes)} ({self.kv_tokens} tokens), expert cache "
                f"{gb(self.expert_bytes)} ({self.expert_slots} slots = "
                f"{100 * self.expert_fraction:.0f}% of experts), workspace {gb(self.workspace_bytes)}"
                + (f", recurrent states {gb(self.state_bytes)}" if self.state_bytes else "")
                + (f", state checkpoints {gb(self.checkpoint_bytes)}" if self.checkpoint_bytes else ""))


def dtype_bytes(cfg: ModelConfig) -> int:
    """Bytes per stored weight: bf16 stays 2; fp32 and fp16 checkpoints are f32 in memory."""
    return 4 if cfg.torch_dtype in ("float32", "float16") else 2


def weight_bytes(cfg: ModelConfig) -> int:
    """Everything but the routed experts: embeddings, lm_head, attention, norms, routers, dense MLPs
    (a hybrid's: its GDN layers and shared experts too)."""
    if cfg.has_gdn:
        from freetoken.models.gdn_weights import gdn_param_count
        routed = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return (gdn_param_count(cfg) - routed) * dtype_bytes(cfg)
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + H
    for layer in range(cfg.num_layers):
        n += (Hq + 2 * G) * D * H + H * Hq * D + 2 * H + 2 * D
        n += cfg.num_experts * H if cfg.is_moe_layer(layer) else 3 * H * cfg.intermediate_size
    return n * dtype_bytes(cfg)


def expert_bytes(cfg: ModelConfig) -> int:
    """One expert: gate_up [2I, H] + down [H, I]."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes(cfg)


def kv_bytes_per_token(cfg: ModelConfig, ec: EngineConfig) -> int:
    kind = ec.kv_dtype if ec.kv_dtype != "auto" else ("float32" if dtype_bytes(cfg) == 4 else "bfloat16")
    return 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * (4 if kind == "float32" else 2)


def state_bytes(cfg: ModelConfig, ec: EngineConfig) -> int:
    """A hybrid's recurrent-state pool: one fp32 row per running request (engine/state_pool.py)."""
    if not cfg.has_gdn:
        return 0
    from freetoken.engine.state_pool import StatePool
    return StatePool.bytes_per_row(cfg) * ec.max_running_requests


def context_len(cfg: ModelConfig, ec: EngineConfig) -> int:
    """--max-model-len as given, even beyond max_position_embeddings (RoPE angles are computed
    from the positions, nothing is sized by the trained length; the engine warns), else the
    trained length."""
    return ec.max_model_len or cfg.max_position_embeddings


def workspace_bytes(cfg: ModelConfig, ec: EngineConfig) -> int:
    """Activations of the largest step plus the gpu ops' scratch (kernels/experts.py and
    kernels/attention.py scratch_bytes, the exact layouts) plus every decode graph's logits."""
    from freetoken.kernels import attention, experts
    H, D, Hq, G, k = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts_per_tok
    B, C = ec.max_running_requests, context_len(cfg, ec)
    T = max(ec.chunked_prefill_size, B)
    per_token = 6 * H + 2 * (Hq + 2 * G) * D + 2 * Hq * D + cfg.num_experts + 2 * k
    acts = ACT_COPIES * 4 * T * per_token
    moe = experts.scratch_bytes(T, k, H, cfg.moe_intermediate_size, cfg.num_experts)
    nch = -(-C // attention._decode_chunk(B, G, C, Hq // G, D))
    decode = attention.scratch_bytes(B, Hq, D, nch)
    logits = 4 * cfg.vocab_size * B * (B + 1) // 2 + 4 * cfg.vocab_size * B
    # the scratch pool is grow-only in powers of two: up to twice the largest request
    return max(MIN_WORKSPACE, acts + 2 * max(moe, decode) + logits)


def _kv_tokens(cfg: ModelConfig, ec: EngineConfig, left: int) -> int:
    per = kv_bytes_per_token(cfg, ec)
    if ec.num_kv_tokens > 0:
        tokens = ec.num_kv_tokens
    else:
        want, one = ec.max_running_requests * context_len(cfg, ec), context_len(cfg, ec)
        tokens = max(min(want, int(KV_MAX_SHARE * left) // per), min(want, one))
    if tokens * per > left:
        raise ConfigError(f"KV cache of {tokens} tokens needs {tokens * per / GB:.2f} GB; "
                          f"{max(left, 0) / GB:.2f} GB are left after weights and workspace")
    return tokens


def _expert_slots(cfg: ModelConfig, ec: EngineConfig, left: int) -> int:
    total, per = len(cfg.moe_layers) * cfg.num_experts, expert_bytes(cfg)
    if ec.moe_backend == "cpu":   # every routed expert runs on the host: no cache
        return 0
    fit = min(total, max(left, 0) // per) if per else total
    # the count moe/options.cache_slots will pick; more slots than L*E experts is L*E
    from_rate = rate_slots(ec.moe_cache_rate, total) if ec.moe_cache_rate > 0 else fit
    want = min(ec.moe_cache_size or from_rate, total)
    if want > fit or (ec.moe_backend == "fused" and fit < total):
        need = total if ec.moe_backend == "fused" else want
        raise ConfigError(f"expert cache of {need} slots ({need * per / GB:.2f} GB) does not fit: "
                          f"{max(left, 0) / GB:.2f} GB are left for experts ({fit} slots)")
    return want


def plan_gpu_memory(cfg: ModelConfig, engine_config: EngineConfig, free_bytes: int) -> GpuPlan:
    """Split min(free memory less RESERVE, --gpu-memory-gb) into the four claims, in order.
    Raises ConfigError naming the claim that does not fit."""
    ec = engine_config
    usable = int(free_bytes * (1 - RESERVE))
    cap = int(getattr(ec, "gpu_memory_gb", 0.0) * GB)   # EngineConfig field --gpu-memory-gb (0: none)
    budget, capped_by = (cap, "--gpu-memory-gb") if 0 < cap < usable else (usable, "free memory")
    weights, work, states = weight_bytes(cfg), workspace_bytes(cfg, ec), state_bytes(cfg, ec)
    left = budget - weights - work - states
    if left <= 0:
        raise ConfigError(f"weights ({weights / GB:.2f} GB), workspace ({work / GB:.2f} GB) and recurrent "
                          f"states ({states / GB:.2f} GB) exceed the GPU budget of {budget / GB:.2f} GB ({capped_by})")
    kv_tokens = _kv_tokens(cfg, ec, left)
    kv = kv_tokens * kv_bytes_per_token(cfg, ec)
    claimed = _checkpoint_claim(cfg, ec, left - kv)
    slots = _expert_slots(cfg, ec, left - kv - claimed)
    spare = left - kv - claimed - slots * expert_bytes(cfg)
    checkpoints = spare if cfg.has_gdn and getattr(ec, "state_checkpoint_gpu_mb", 0) < 0 else claimed
    return GpuPlan(budget, weights, work, kv, kv_tokens, slots, slots * expert_bytes(cfg),
                   len(cfg.moe_layers) * cfg.num_experts, capped_by, states, max(checkpoints, 0))


def _checkpoint_claim(cfg: ModelConfig, ec: EngineConfig, left: int) -> int:
    """--state-checkpoint-gpu-mb N > 0 of a hybrid is claimed before the expert cache; the
    default (-1) takes only what the expert cache leaves (all experts resident, or a cache size
    the user capped), so checkpoints never cost an expert slot unasked."""
    mb = getattr(ec, "state_checkpoint_gpu_mb", 0)
    if not cfg.has_gdn or mb <= 0:
        return 0
    if mb << 20 > left:
        raise ConfigError(f"--state-checkpoint-gpu-mb {mb} does not fit: {max(left, 0) / GB:.2f} GB are "
                          f"left after weights, workspace and KV")
    return mb << 20
