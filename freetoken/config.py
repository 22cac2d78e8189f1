"""Frozen configuration: ModelConfig (from a Hugging Face config.json) and EngineConfig.

CLI flags are generated from EngineConfig's fields (see cli.py), so each default and help text
is written once, here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from freetoken.models import registry

SUPPORTED_ARCHITECTURES = tuple(registry.ARCHITECTURES)
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


class ConfigError(ValueError):
    """A model directory or an engine option that FreeToken cannot use; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3-MoE or hybrid (Gated DeltaNet) model. Shape legend: H hidden, E experts,
    k routed, I expert width; GDN: Hk key heads, Hv value heads, Dk / Dv their dims, K conv kernel."""

    architecture: str
    vocab_size: int
    hidden_size: int                 # H
    num_layers: int                  # L (decoder layers)
    num_heads: int                   # query heads
    num_kv_heads: int                # key/value heads (GQA groups)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None        # None or {"rope_type": "linear", "factor": f}
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int                 # E
    num_experts_per_tok: int         # k
    moe_intermediate_size: int       # I
    norm_topk_prob: bool
    intermediate_size: int           # width of the dense MLP of non-MoE layers
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    torch_dtype: str = "bfloat16"
    # hybrid models (registry.Family.hybrid); the defaults describe a model without GDN layers
    layer_types: tuple[str, ...] = ()          # per layer FULL_ATTENTION | LINEAR_ATTENTION; () = all full
    linear_num_key_heads: int = 0              # Hk
    linear_num_value_heads: int = 0            # Hv (a multiple of Hk)
    linear_key_head_dim: int = 0               # Dk
    linear_value_head_dim: int = 0             # Dv
    linear_conv_kernel_dim: int = 4            # K
    shared_expert_intermediate_size: int = 0   # 0: no shared expert
    partial_rotary_factor: float = 1.0         # fraction of head_dim that RoPE rotates
    attn_output_gate: bool = False             # q_proj also yields a sigmoid gate per head

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, top: dict) -> "ModelConfig":
        """Map every Hugging Face key FreeToken uses, in one place."""
        arch = (top.get("architectures") or [None])[0]
        fam = registry.family(arch)
        if fam is None:
            raise ConfigError(f"unsupported architecture {arch!r}; supported: {registry.supported()}")
        cfg = top
        if fam.text_config and "text_config" in top:   # the wrapper's own tie flag wins (transformers reads only it)
            cfg = {**top, **top["text_config"], "tie_word_embeddings": top.get("tie_word_embeddings", False)}
        theta, scaling = _rope_fields(cfg)
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise ConfigError("config.json has neither num_experts nor num_local_experts")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=int(experts),
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=fam.router_renormalises or bool(cfg.get("norm_topk_prob", False)),
            intermediate_size=cfg.get("intermediate_size", cfg["moe_intermediate_size"]),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            **(_hybrid_fields(cfg) if fam.hybrid else {}),
        )

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each GDN layer; the recurrent-state pool numbers them in order."""
        return tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each full-attention layer; the KV pool numbers them in order."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def conv_dim(self) -> int:
        """GDN conv channels C: q and k (Hk * Dk each) then v (Hv * Dv)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen3-MoE rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each MoE layer; the MoE cache numbers layers 0..len-1 in this order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))


def _hybrid_fields(cfg: dict) -> dict:
    """The Gated DeltaNet hybrid keys (Qwen3-Next, Qwen3.5/3.6-MoE), checked for consistency."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:        # every full_attention_interval-th layer is full attention
        every = int(cfg.get("full_attention_interval") or 4)
        types = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(n)]
    if len(types) != n or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in types):
        raise ConfigError(f"layer_types must list {n} of {FULL_ATTENTION!r} / {LINEAR_ATTENTION!r}, got {types}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg.get('hidden_act')!r}: Gated DeltaNet models need silu")
    params = cfg.get("rope_parameters") or {}
    out = dict(layer_types=tuple(types), linear_num_key_heads=int(cfg["linear_num_key_heads"]),
               linear_num_value_heads=int(cfg["linear_num_value_heads"]),
               linear_key_head_dim=int(cfg["linear_key_head_dim"]),
               linear_value_head_dim=int(cfg["linear_value_head_dim"]),
               linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
               shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
               partial_rotary_factor=float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))),
               attn_output_gate=bool(cfg.get("attn_output_gate", True)))
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return out


def _rope_fields(cfg: dict) -> tuple[float, dict | None]:
    """RoPE theta and scaling from rope_theta/rope_scaling or transformers-5 rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0)))
    rope_type = (params.get("rope_type") or (scaling or {}).get("rope_type")
                 or (scaling or {}).get("type") or "default")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        factor = params.get("factor", (scaling or {}).get("factor"))
        return float(theta), {"rope_type": "linear", "factor": float(factor)}
    raise ConfigError(f"unsupported rope type {rope_type!r}; supported: default, linear")


def _flag(default, help_text: str, choices: tuple | None = None, **extra):
    meta = {"help": help_text, **extra}
    if choices:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model. Unknown keywords raise TypeError."""

    model: str | None = _flag(None, "model directory (Hugging Face format), or a built-in model: demo "
                                    "(tiny-agent-moe, the default) or demo-hybrid (tiny-agent-hybrid)")
    backend: str = _flag("auto", "compute backend: auto picks cuda when a GPU is visible, else cpu",
                         ("auto", "ref", "cpu", "cuda"))
    max_running_requests: int = _flag(4, "most requests decoding at once")
    num_kv_tokens: int = _flag(0, "KV pool size in tokens (0: sized from the context length and running requests)")
    max_model_len: int = _flag(0, "context length in tokens (0: the model's max_position_embeddings; "
                                  "beyond it runs, with a warning)")
    kv_dtype: str = _flag("auto", "KV cache dtype: auto is float32 for fp32 checkpoints, else bfloat16",
                          ("auto", "bfloat16", "float32"))
    chunked_prefill_size: int = _flag(8192, "most prompt tokens computed in one forward")
    enable_prefix_cache: bool = _flag(True, "reuse the KV of cached prompt prefixes (radix tree)")
    state_checkpoint_mb: int = _flag(-1, "hybrid models: host memory for recurrent-state checkpoints in MiB, which "
                                     "let a cached prefix be reused (-1: 32 per running request, at most 1/8 of "
                                     "the available memory; 0: none)")
    state_checkpoint_gpu_mb: int = _flag(-1, "hybrid models on a GPU: device memory for the newest state checkpoints "
                                         "in MiB (-1: what the memory plan leaves after the expert cache; 0: none)")
    semantic_anchors: bool = _flag(True, "hybrid models: checkpoint the recurrent state at turn ends, </think>, "
                                   "tool-call openers and tool results (--no-semantic-anchors: only the interval)")
    state_checkpoint_interval: int = _flag(4096, "hybrid models: also checkpoint every N prompt tokens "
                                           "(0: only at anchors)")
    moe_backend: str = _flag("auto", "how routed experts run", ("auto", "fused", "offload", "cpu", "hybrid"))
    moe_cache_size: int = _flag(0, "expert cache slots (0: from --moe-cache-rate or the memory budget)")
    moe_cache_rate: float = _flag(0.0, "expert cache size as a fraction of all L*E experts")
    moe_hybrid_max_fetch: int = _flag(-1, "hybrid: -1 uses the q* rule, N >= 0 fetches at most N misses per layer")
    moe_fetch_fraction: float = _flag(-1.0, "hybrid: explicit phi = B_P/B_H in [0, inf) (-1: from the bandwidth profile)")
    moe_min_fill: int = _flag(0, "hybrid: fetch at least one miss per layer-step when there is one "
                              "(0 measured faster: docs/performance.md)", (0, 1))
    moe_fill_order: str = _flag("recency", "order of the misses to fill: most recently routed first, "
                                "or lowest expert id (recency measured better)", ("recency", "lowest_id"))
    moe_prefill_decode_tokens: int = _flag(
        32, "offload/hybrid: prefill chunks shorter than this run through the expert cache like "
        "decode instead of streaming whole layers (0: never; 32 measured: docs/performance.md)")
    moe_cpu_threads: int = _flag(0, "CPU expert executor threads (0: physical cores)")
    disable_moe_prefill_overlap: bool = _flag(
        False, "prefill: load each MoE layer in turn instead of streaming layer l+1 while layer l "
        "computes (overlap needs >= 2E expert slots)")
    disable_cuda_graph: bool = _flag(False, "run decode eagerly instead of replaying CUDA graphs")
    disable_thread_tuning: bool = _flag(
        False, "cpu backend: keep every compute thread even when decode slows down (by default a "
        "slowdown, e.g. another process busy on a core, tries one thread fewer and keeps it while faster)")
    gpu_memory_gb: float = _flag(0.0, "cap the GPU memory FreeToken may use, in GB (0: all that is free)")
    seed: int = _flag(0, "default sampling seed for requests that give none")

    def replace(self, **changes) -> "EngineConfig":
        from dataclasses import replace
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
