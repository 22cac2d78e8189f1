"""Synthetic Gated DeltaNet hybrids (``synth:qwen3.6-35b-a3b``, ``synth:qwen3-next-80b-a3b``,
``synth:tiny-hybrid``): the real geometry of those models with synth.py's deterministic random
bf16 weights, so memory plans and benchmarks run the real shapes without a checkpoint.

Shape legend: H hidden, E experts, I expert width, Is shared-expert width, Hk / Hv GDN key /
value heads, Dk / Dv their dims, C conv channels, K conv kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GdnShape:
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    key_heads: int            # Hk
    value_heads: int          # Hv
    key_dim: int              # Dk
    value_dim: int            # Dv
    full_every: int = 4       # full_attention_interval
    partial_rotary: float = 0.25
    max_positions: int = 262144
    embed_scale: float = 8.0  # routing knobs as synth.SynthShape (the gdn layers have no q/k norm)
    qk_scale: float = 2.0

    def hf_config(self) -> dict:
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab,
            "num_experts": self.experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_intermediate,
            "shared_expert_intermediate_size": self.shared_intermediate, "norm_topk_prob": True,
            "linear_num_key_heads": self.key_heads, "linear_num_value_heads": self.value_heads,
            "linear_key_head_dim": self.key_dim, "linear_value_head_dim": self.value_dim,
            "linear_conv_kernel_dim": 4, "full_attention_interval": self.full_every,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": self.partial_rotary},
            "rms_norm_eps": 1e-6, "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "eos_token_id": 2,
        }


PRESETS = {
    "qwen3.6-35b-a3b": GdnShape(hidden=2048, layers=40, experts=256, top_k=8, moe_intermediate=512,
                                   shared_intermediate=512, heads=16, kv_heads=2, head_dim=256, vocab=248320,
                                   key_heads=16, value_heads=32, key_dim=128, value_dim=128),
    "qwen3-next-80b-a3b": GdnShape(hidden=2048, layers=48, experts=512, top_k=10, moe_intermediate=512,
                                      shared_intermediate=512, heads=16, kv_heads=2, head_dim=256,
                                      vocab=151936, key_heads=16, value_heads=32, key_dim=128, value_dim=128),
    "tiny-hybrid": GdnShape(hidden=64, layers=4, experts=8, top_k=2, moe_intermediate=32,
                               shared_intermediate=32, heads=4, kv_heads=2, head_dim=16, vocab=4096,
                               key_heads=2, value_heads=4, key_dim=16, value_dim=16, max_positions=4096),
}


def layers(cfg, shape: GdnShape, gen) -> tuple:
    """GdnLayerWeights of every layer, drawn from synth's generator in a fixed order."""
    from freetoken.models.gdn_weights import GdnLayerWeights
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = []
    for i in range(cfg.num_layers):
        mixer = _gdn(cfg, gen) if cfg.is_linear_layer(i) else _attention(cfg, shape, gen)
        out.append(GdnLayerWeights(
            input_norm=gen.norm(H), post_norm=gen.norm(H), **mixer,
            router=gen.matrix((E, H)), gate_up=gen.matrix((E, 2 * I, H)), down=gen.matrix((E, H, I)),
            shared_gate_up=gen.matrix((1, 2 * Is, H)), shared_down=gen.matrix((1, H, Is)),
            shared_gate=gen.matrix((1, H))))
    return tuple(out)


def _attention(cfg, shape: GdnShape, gen) -> dict:
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    return dict(qkv=gen.matrix(((2 * Hq + 2 * G) * D, H)), o_proj=gen.matrix((H, Hq * D)),
                q_norm=gen.norm(D, shape.qk_scale), k_norm=gen.norm(D, shape.qk_scale))


def _gdn(cfg, gen) -> dict:
    H, Hv, Dv, C = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim
    rng = np.random.default_rng([gen.seed, gen.count, 0xD1A])
    return dict(in_proj=gen.matrix((C + Hv * Dv + 2 * Hv, H)), conv=gen.matrix((C, cfg.linear_conv_kernel_dim), 3),
                A_log=np.log(rng.uniform(1, 16, Hv)).astype(np.float32), dt_bias=np.ones(Hv, np.float32),
                gdn_norm=gen.norm(Dv), out_proj=gen.matrix((H, Hv * Dv)))


def weight_bytes(cfg) -> int:
    """bf16 bytes of every weight of a hybrid of this config."""
    from freetoken.models.gdn_weights import gdn_param_count
    return 2 * gdn_param_count(cfg)
