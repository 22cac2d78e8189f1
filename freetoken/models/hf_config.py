"""A Hugging Face config.json -> ModelConfig: every HF key FreeToken uses, in one place, and the
architecture's family from the one table (models/registry.py)."""
from __future__ import annotations

import json
from pathlib import Path

from freetoken.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, ModelConfig
from freetoken.models import registry


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory (its config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    return model_config_from_dict(json.loads(path.read_text()))


def _check_quantization(qc, arch: str) -> None:
    """A quantized checkpoint FreeToken reads: Qwen's block FP8 (models/fp8_weights.py), of any
    registered family (Qwen3-MoE, the GDN models)."""
    if qc is None:
        return
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    if method == "mxfp4" and registry.family(arch).gpt_oss:     # its experts' blocks: models/gpt_oss_weights.py
        return
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r}: FreeToken reads block FP8 (\"fp8\") "
                          "checkpoints and GGUF files (docs/formats.md)")
    if qc.get("fmt", "e4m3") != "e4m3" or list(block or []) != [128, 128]:
        raise ConfigError(f"FP8 checkpoint with fmt {qc.get('fmt')!r} and weight_block_size {block}: FreeToken "
                          "reads e4m3 weights in [128, 128] blocks")


def model_config_from_dict(top: dict) -> ModelConfig:
    """Map every Hugging Face key FreeToken uses, in one place."""
    arch = (top.get("architectures") or [None])[0]
    fam = registry.family(arch)
    if fam is None:
        raise ConfigError(f"unsupported architecture {arch!r}; supported: {registry.supported()}")
    cfg = top
    if fam.text_config and "text_config" in top:   # the wrapper's own tie flag wins (transformers reads only it)
        cfg = {**top, **top["text_config"], "tie_word_embeddings": top.get("tie_word_embeddings", False)}
    _check_quantization(top.get("quantization_config"), arch)
    cfg = _gpt_oss_defaults(cfg) if fam.gpt_oss else cfg
    theta, scaling = _rope_fields(cfg)
    heads = cfg["num_attention_heads"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    width = cfg["intermediate_size" if fam.gpt_oss else "moe_intermediate_size"]   # I: gpt-oss has only experts
    if experts is None:
        raise ConfigError("config.json has neither num_experts nor num_local_experts")
    return _rope_checked(ModelConfig(
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
        moe_intermediate_size=width,
        norm_topk_prob=fam.router_renormalises or bool(cfg.get("norm_topk_prob", False)),
        intermediate_size=cfg.get("intermediate_size", width),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        **(_gdn_fields(cfg) if fam.gdn else {}),
        **(_gpt_oss_fields(cfg) if fam.gpt_oss else {}),
    ))


def _rope_checked(cfg: ModelConfig) -> ModelConfig:
    """YaRN's attention factor reaches the models as the softmax scale (models/rope_freqs.py), which
    is right only when RoPE rotates every dim of a head."""
    if (cfg.rope_scaling or {}).get("rope_type") == "yarn" and cfg.rotary_dim != cfg.head_dim:
        raise ConfigError("YaRN rope with a partial rotary dimension is not supported: its attention factor scales "
                          "only the rotated dims of q and k")
    return cfg


def _gdn_fields(cfg: dict) -> dict:
    """The Gated DeltaNet model keys (Qwen3-Next, Qwen3.5/3.6-MoE), checked for consistency."""
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


def _gpt_oss_defaults(cfg: dict) -> dict:
    """gpt-oss's keys a config.json may leave out, as transformers' GptOssConfig fills them in."""
    defaults = {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5}
    if "rope_scaling" not in cfg and "rope_parameters" not in cfg:
        defaults["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096}
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        defaults["rope_theta"] = 150000.0
    return {**defaults, **cfg}


def _gpt_oss_fields(cfg: dict) -> dict:
    """gpt-oss's keys: which layers slide over a window (layer_types, else every other layer from
    the first, as transformers defaults), sinks and biases (always present), the clamped SwiGLU."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"layer_types must list {n} of 'sliding_attention' / 'full_attention', got {types}")
    window = int(cfg.get("sliding_window") or 0)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    return dict(sliding_window=window, sliding_layers=sliding, attention_sinks=True, expert_bias=True,
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate",
             "attention_factor", "mscale", "mscale_all_dim")


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
    if rope_type == "yarn":
        merged = {**(scaling or {}), **params}
        if "original_max_position_embeddings" not in merged:
            merged["original_max_position_embeddings"] = cfg["max_position_embeddings"]
        if merged.get("factor") is None:
            merged["factor"] = cfg["max_position_embeddings"] / merged["original_max_position_embeddings"]
        return float(theta), {"rope_type": "yarn", **{k: merged[k] for k in YARN_KEYS if merged.get(k) is not None}}
    raise ConfigError(f"unsupported rope type {rope_type!r}; supported: default, linear, yarn")
