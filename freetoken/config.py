"""Frozen configuration: ModelConfig (a model's shape; models/hf_config.py reads it from a Hugging
Face config.json) and EngineConfig.

CLI flags are generated from EngineConfig's fields (see flags.py), so each default and help text
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
    rope_scaling: dict | None        # None, {"rope_type": "linear", "factor": f} or a "yarn" dict (models/rope_freqs.py)
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
    # gpt-oss (registry.Family.gpt_oss); the defaults describe a model without these features
    sliding_window: int = 0                    # W: a sliding layer's token sees its last W positions
    sliding_layers: tuple[int, ...] = ()       # decoder layers that attend over a window of W
    attention_sinks: bool = False              # a learned logit per query head joins every softmax
    expert_bias: bool = False                  # the router and the routed experts add biases
    swiglu_limit: float = 0.0                  # > 0: the clamped SwiGLU (kernels/experts.py, glu)
    swiglu_alpha: float = 1.0                  # its sigmoid gain

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
        """Decoder-layer index of each full-attention layer; the KV pool numbers them in order (a
        sliding layer's KV is per-request state: engine/window_pool.py)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i) and not self.window(i))

    @property
    def sliding_kv(self) -> bool:
        """Sliding-window layers whose last W positions are kept per request (engine/window_pool.py)."""
        return self.sliding_window > 0 and bool(self.sliding_layers)

    @property
    def keeps_request_state(self) -> bool:
        """A request carries state beside the KV pool's (GDN states, sliding windows): one state row
        a running request, and a cached prefix is resumed only at a state checkpoint."""
        return self.has_gdn or self.sliding_kv

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def conv_dim(self) -> int:
        """GDN conv channels C: q and k (Hk * Dk each) then v (Hv * Dv)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def window(self, layer: int) -> int:
        """W of a sliding-window layer, 0 for a layer that attends over the whole context."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def glu(self) -> tuple[float, float] | None:
        """(alpha, limit) of the clamped SwiGLU for the experts op, or None (plain SwiGLU)."""
        return (self.swiglu_alpha, self.swiglu_limit) if self.swiglu_limit > 0 else None

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen3-MoE rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each MoE layer; the MoE cache numbers layers 0..len-1 in this order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))


def _flag(default, help_text: str, choices: tuple | None = None, kind: type | None = None, **extra):
    """A field with its flag's help and choices; kind: the value type of a field whose default is
    None ("auto": decided at start-up by the plan, engine/plan.py)."""
    meta = {"help": help_text, **extra}
    if choices:
        meta["choices"] = choices
    if kind is not None:
        meta["kind"] = kind
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model, as the user gave it: None is "auto" (the
    start-up plan, engine/plan.py, decides and says why). Never rewritten after start-up; every
    bound is checked once, by engine/plan_checks.py. Unknown keywords raise TypeError."""

    model: str | None = _flag(None, "model directory (Hugging Face format), a GGUF file (FILE.gguf; a split set by "
                                    "its first part), synth:SPEC (an in-memory synthetic model), or a built-in "
                                    "model: demo (tiny-agent-moe, the default), demo-hybrid (tiny-agent-hybrid) or "
                                    "demo-oss (tiny-agent-oss, a gpt-oss)")
    backend: str = _flag("auto", "compute backend: auto picks cuda when a GPU is visible, else cpu",
                         ("auto", "ref", "cpu", "cuda"))
    max_running_requests: int = _flag(4, "most requests decoding at once")
    num_kv_tokens: int | None = _flag(None, "KV pool size in tokens (auto: from the context length and running "
                                            "requests, within the memory plan)", kind=int)
    max_model_len: int | None = _flag(None, "context length in tokens (auto: the model's max_position_embeddings; "
                                            "beyond it runs, with a warning)", kind=int)
    quantize_experts: str = _flag("none", "quantize a dense checkpoint's routed experts at load (q8_0: GGUF's "
                                  "Q8_0 blocks; q4_k: GGUF's Q4_K blocks; fp8: e4m3 in row blocks of 128), the "
                                  "quantization error logged once; a quantized checkpoint's experts are left as "
                                  "they are", ("none", "q8_0", "q4_k", "fp8"))
    cpu_dots: str = _flag("int8", "how the CPU multiplies by GGUF block weights (q4_0 .. q8_0, q2_k .. q6_k, "
                          "mxfp4; cpu backend, and the hybrid's CPU experts) and by bf16 experts (cpu and ref backends): int8 rounds each 32 "
                          "activations to 8 bits and sums exact integers (VNNI or AVX2), and rounds bf16 "
                          "experts' inputs to bf16 (AVX512-BF16 vdpbf16ps prefill), as llama.cpp does; f32 "
                          "multiplies by the fp32 activations (slower, no rounding)", ("int8", "f32"))
    kv_dtype: str = _flag("auto", "KV cache dtype: auto is float32 for fp32 checkpoints, bfloat16 for bf16 or quantized ones",
                          ("auto", "bfloat16", "float32"))
    chunked_prefill_size: int = _flag(8192, "most prompt tokens computed in one forward")
    enable_prefix_cache: bool = _flag(True, "reuse the KV of cached prompt prefixes (radix tree)")
    state_checkpoint_mb: int | None = _flag(
        None, "GDN and sliding-window models: host memory for state checkpoints in MiB, which let a cached prefix be "
        "reused (auto: 32 per running request, at most 1/8 of the available memory; 0: none)", kind=int)
    state_checkpoint_gpu_mb: int | None = _flag(
        None, "GDN and sliding-window models on a GPU: device memory for the newest state checkpoints in MiB (auto: what the "
        "memory plan leaves after the expert cache; 0: none)", kind=int)
    semantic_anchors: bool = _flag(True, "GDN and sliding-window models: checkpoint the state at turn ends, "
                                   "</think>, tool-call openers and tool results (--no-semantic-anchors: only the interval)")
    state_checkpoint_interval: int = _flag(4096, "GDN and sliding-window models: also checkpoint every N prompt tokens "
                                           "(0: only at anchors)")
    moe_backend: str = _flag("auto", "how routed experts run: fused (all on the GPU), offload (a GPU expert "
                             "cache, misses fetched), hybrid (a GPU expert cache, misses split between "
                             "fetching and the CPU), cpu", ("auto", "fused", "offload", "cpu", "hybrid"))
    moe_cache_size: int | None = _flag(None, "expert cache slots (auto: --moe-cache-rate, else the memory plan)",
                                       kind=int)
    moe_cache_rate: float | None = _flag(None, "expert cache size as a fraction of all L*E experts, in (0, 1]",
                                         kind=float)
    moe_hybrid_max_fetch: int | None = _flag(None, "hybrid: fetch at most N >= 0 misses per layer-step "
                                                   "(auto: the q* rule)", kind=int)
    moe_fetch_fraction: float | None = _flag(None, "hybrid: phi = B_P/B_H >= 0 for the q* rule (auto: from the "
                                                   "bandwidth profile)", kind=float)
    moe_min_fill: int = _flag(0, "hybrid: fetch at least one miss per layer-step when there is one "
                              "(0 measured faster: docs/performance.md)", (0, 1))
    moe_fill_order: str = _flag("recency", "order of the misses to fill: most recently routed first, "
                                "or lowest expert id (recency measured better)", ("recency", "lowest_id"))
    moe_prefill_decode_tokens: int = _flag(
        32, "offload/hybrid: prefill chunks shorter than this run through the expert cache like "
        "decode instead of streaming whole layers (0: never; 32 measured: docs/performance.md)")
    moe_cpu_threads: int | None = _flag(None, "CPU expert executor threads (auto: numba's thread count)", kind=int)
    moe_prefill_overlap: bool = _flag(
        True, "prefill: stream MoE layer l+1 while layer l computes (needs >= 2E expert slots; "
        "--no-moe-prefill-overlap loads each layer in turn)")
    cuda_graph: bool = _flag(True, "replay decode steps as captured CUDA graphs (--no-cuda-graph: run "
                                   "decode eagerly)")
    cpu_decode_layer: bool = _flag(
        True, "cpu backend: run the attention half of a decode step's layer in one numba call "
        "(--no-cpu-decode-layer calls each op from Python: the same results, slower)")
    cpu_interleave_q4_0: bool = _flag(
        True, "cpu backend with --cpu-dots int8 on a CPU with VNNI: rewrite q4_0 expert banks (and qkv and o_proj "
        "when every layer's is q4_0) at load, in place, 16 rows interleaved, so a decode dot gives 16 rows at once "
        "(--no-cpu-interleave-q4-0 keeps the file's layout: the same results within fp32 rounding, slower decode)")
    thread_tuning: bool = _flag(
        True, "cpu backend: when decode slows down (e.g. another process busy on a core) try one "
        "thread fewer and keep it while faster (--no-thread-tuning keeps every compute thread)")
    host_scratch_reuse: bool = _flag(
        True, "set glibc malloc (mallopt: 32 MB mmap threshold, 64 MB top pad) so each prompt reuses "
        "the host scratch pages the last one freed instead of page-faulting new ones; process-wide "
        "(--no-host-scratch-reuse leaves malloc as the process had it)")
    gpu_memory_gb: float | None = _flag(None, "cap the GPU memory FreeToken may use, in GB (auto: all that is free)",
                                        kind=float)
    seed: int = _flag(0, "default sampling seed for requests that give none")

    def replace(self, **changes) -> "EngineConfig":
        from dataclasses import replace
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
