"""Synthetic gpt-oss models (``synth:gpt-oss-20b``, ``synth:gpt-oss-120b``, ``synth:tiny-gpt-oss``):
the public configs' geometry, with the weights as the hub ships them: the experts in MXFP4 blocks
(synth._Generator.mxfp4: random codes, exponents 2**-9 .. 2**-6), everything else bf16 from synth.py's
generator, the biases and sinks fp32. ``,layers=N`` keeps a 120b (~65 GB) or a 20b (~14 GB) in memory.

The config goes through hf_config as a config.json of the hub would (hf_config._gpt_oss_fields):
every other layer slides over a window from the first, YaRN rope. The routing knob embed_scale works
as for the other presets; qk_scale does not apply (gpt-oss has no q/k norms): parse_spec refuses it.

Shape legend: H hidden, E experts, I expert width, Hq query heads, G kv heads, D head dim, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# what the hub's quantization_config keeps out of MXFP4 (read for its method only)
_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@dataclass(frozen=True)
class GptOssShape:
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_intermediate: int     # I (config.json's intermediate_size): a multiple of 32, MXFP4's block
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    sliding_window: int = 128
    max_positions: int = 131072
    embed_scale: float = 8.0  # routing knob as synth.SynthShape (no qk_scale: no q/k norms)

    def hf_config(self) -> dict:
        """config.json as the hub's gpt-oss-20b/120b write it, at this shape."""
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)]
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab,
            "num_local_experts": self.experts, "num_experts_per_tok": self.top_k, "experts_per_token": self.top_k,
            "intermediate_size": self.moe_intermediate, "layer_types": types, "sliding_window": self.sliding_window,
            "attention_bias": True, "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": False},
            "max_position_embeddings": self.max_positions, "initial_context_length": 4096,
            "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "tie_word_embeddings": False, "hidden_act": "silu",
            "torch_dtype": "bfloat16", "eos_token_id": 2,
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": _NOT_CONVERTED},
        }


_GPT_OSS_20B = GptOssShape(hidden=2880, layers=24, experts=32, top_k=4, moe_intermediate=2880, heads=64,
                           kv_heads=8, head_dim=64, vocab=201088)
PRESETS = {
    "gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-120b": replace(_GPT_OSS_20B, layers=36, experts=128),
    "tiny-gpt-oss": GptOssShape(hidden=64, layers=4, experts=8, top_k=4, moe_intermediate=64, heads=4,
                                kv_heads=2, head_dim=16, vocab=4096, sliding_window=8, max_positions=1024),
}


def layers(cfg, shape: GptOssShape, gen) -> tuple:
    """GptOssLayerWeights of every layer, drawn from synth's generator in a fixed order."""
    from freetoken.models.gpt_oss_weights import GptOssLayerWeights
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    out = []
    for _ in range(cfg.num_layers):
        f32 = _f32_draws(gen)
        out.append(GptOssLayerWeights(
            input_norm=gen.norm(H), post_norm=gen.norm(H),
            qkv=gen.matrix(((Hq + 2 * G) * D, H)), qkv_bias=f32((Hq + 2 * G) * D),
            o_proj=gen.matrix((H, Hq * D)), o_bias=f32(H), sinks=f32(Hq, std=1.0),
            router=gen.matrix((E, H)), router_bias=f32(E),
            gate_up=gen.mxfp4((E, 2 * I, H)), down=gen.mxfp4((E, H, I)),
            gate_up_bias=f32(E, 2 * I), down_bias=f32(E, H)))
    return tuple(out)


def _f32_draws(gen):
    """draw(*shape, std=0.02): fp32 N(0, std) arrays (biases; sinks at std 1) from a numpy generator
    seeded by (seed, the generator's count), counted in gen.nbytes."""
    rng = np.random.default_rng([gen.seed, gen.count, 0x6055])

    def draw(*shape, std=0.02):
        a = np.float32(std) * rng.standard_normal(shape, dtype=np.float32)
        gen.nbytes += a.nbytes
        return a
    return draw


def weight_bytes(cfg) -> int:
    """Bytes of every weight as generated: bf16 matrices and norms, fp32 biases and sinks, the
    experts in MXFP4 blocks (17 bytes per 32 values)."""
    H, V, D, Hq, G = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    qkv = (Hq + 2 * G) * D
    bf16 = 2 * H + qkv * H + H * Hq * D + E * H
    f32 = qkv + H + Hq + E + E * 2 * I + E * H
    return 2 * (2 * V * H + H) + cfg.num_layers * (2 * bf16 + 4 * f32 + 3 * E * I * H // 32 * 17)
