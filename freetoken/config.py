"""Frozen configuration: ModelConfig (a model's shape; models/hf_config.py reads it from a Hugging
Face config.json) and EngineConfig.

CLI flags are generated from EngineConfig's fields (see cli.py), so each default and help text
is written once, here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

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
    # Gated DeltaNet models (registry.Family.gdn); the defaults describe a model without GDN layers
    layer_types: tuple[str, ...] = ()          # per layer FULL_ATTENTION | LINEAR_ATTENTION; () = all full
    linear_num_key_heads: int = 0              # Hk
    linear_num_value_heads: int = 0            # Hv (a multiple of Hk)
    linear_key_head_dim: int = 0               # Dk
    linear_value_head_dim: int = 0             # Dv
    linear_conv_kernel_dim: int = 4            # K
    shared_expert_intermediate_size: int = 0   # 0: no shared expert
    partial_rotary_factor: float = 1.0         # fraction of head_dim that RoPE rotates
    attn_output_gate: bool = False             # q_proj also yields a sigmoid gate per head

    @property
    def has_gdn(self) -> bool:
        """Gated DeltaNet layers (a recurrent state per request) between full-attention layers."""
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
