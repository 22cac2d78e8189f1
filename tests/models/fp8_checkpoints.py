"""Block-FP8 checkpoints written in numpy for the tests (no torch): a random Qwen3-MoE whose
linears are quantized as Qwen's FP8 releases store them (float8_e4m3fn codes, [128, 128] tile
scales as weight_scale_inv), and its dense twin holding the FP8 values dequantized by the spec,
so FreeToken on one must compute what it computes on the other."""
import json
import shutil
from pathlib import Path

import numpy as np

from freetoken.kernels.qfp8 import e4m3_table
from freetoken.models.demo import random_config, random_tensors, synth_tokenizer_dir
from freetoken.models.safetensors_io import save_safetensors

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def to_e4m3(values: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn code of each value (|v| <= 448)."""
    table = e4m3_table()
    codes = np.arange(128, dtype=np.uint8)[:0x7F]                 # non-negative, NaN left out
    mags = table[codes]
    idx = np.clip(np.searchsorted(mags, np.abs(values)), 1, len(mags) - 1)
    lower = np.abs(values) - mags[idx - 1] < mags[idx] - np.abs(values)
    code = codes[np.where(lower, idx - 1, idx)]
    return np.where(values < 0, code | 0x80, code).astype(np.uint8)


def quantize(w: np.ndarray, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes u8[M,K], scales [ceil(M/128), ceil(K/128)] as float32 values of scale_dtype)."""
    M, K = w.shape
    tiles = np.zeros((-(-M // 128) * 128, -(-K // 128) * 128), np.float32)
    tiles[:M, :K] = np.abs(w)
    amax = tiles.reshape(-(-M // 128), 128, -(-K // 128), 128).max(axis=(1, 3))
    scales = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
    if scale_dtype == "bfloat16":
        scales = (scales.view(np.uint32) & 0xFFFF0000).view(np.float32)
    full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:M, :K]
    return to_e4m3(w / full), scales


def write_fp8_pair(root: Path, scale_dtype: str = "float32", **shape) -> tuple[Path, Path]:
    """(FP8 directory, its dense twin) of one random model; every dim a multiple of 128 keeps
    blocks (another K is widened at load)."""
    cfg = random_config(**{"hidden": 128, "layers": 2, "experts": 8, "top_k": 2, "moe_intermediate": 128,
                           "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 4096, "dtype": "float32", **shape})
    tensors = random_tensors(cfg, seed=3, std=0.05)
    converted = [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED]
    return write_pair(root, cfg, tensors, converted, scale_dtype)


def write_pair(root: Path, cfg: dict, tensors: dict, converted: list[str], scale_dtype: str = "float32",
               skip: tuple[str, ...] = ("lm_head", "model.embed_tokens", "mlp.gate")) -> tuple[Path, Path]:
    """The FP8 checkpoint with the `converted` linears as FP8 codes and scales, and its dense twin
    holding their dequantized values; the rest identical."""
    dense, fp8, tags = {}, {}, {}
    for name, w in tensors.items():
        if name in converted:
            codes, scales = quantize(w, scale_dtype)
            full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
            dense[name] = e4m3_table()[codes] * full
            fp8[name], fp8[name + "_scale_inv"] = codes, scales
            tags[name], tags[name + "_scale_inv"] = "F8_E4M3", "BF16" if scale_dtype == "bfloat16" else "F32"
        else:
            dense[name] = fp8[name] = w
            tags[name] = "F32"
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "modules_to_not_convert": list(skip)}
    out = []
    for kind, tensors, config in (("fp8", fp8, {**cfg, "quantization_config": qc}), ("dense", dense, cfg)):
        d = root / kind
        d.mkdir(parents=True, exist_ok=True)
        save_safetensors(d / "model.safetensors", tensors, tags if kind == "fp8" else "F32")
        (d / "config.json").write_text(json.dumps(config, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(synth_tokenizer_dir() / name, d / name)
        out.append(d)
    return out[0], out[1]


# --- the GDN families: a random model at widths that keep FP8 blocks -----------------------------
GDN = dict(hidden_size=128, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
           shared_expert_intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
           linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=4, linear_value_head_dim=32,
           linear_conv_kernel_dim=4, vocab_size=4096, max_position_embeddings=512, rms_norm_eps=1e-6,
           tie_word_embeddings=True, hidden_act="silu", dtype="float32", eos_token_id=2, pad_token_id=0)


def gdn_config(arch: str) -> dict:
    """Qwen3.5-MoE (layer_types, split in_proj) or Qwen3-Next (full_attention_interval, packed)."""
    if arch == "qwen3next":
        return {**GDN, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                "full_attention_interval": 2, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {**GDN, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "layer_types": ["linear_attention", "full_attention"],
            "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"}}


def gdn_tensors(cfg: dict, seed: int = 4) -> dict:
    """Every tensor the HF GDN checkpoints hold (names as in tests/fixtures/hf/qwen3*), random."""
    rng = np.random.default_rng(seed)
    g = cfg.get
    H, E, I, Is = g("hidden_size"), g("num_experts"), g("moe_intermediate_size"), g("shared_expert_intermediate_size")
    Hq, G, D = g("num_attention_heads"), g("num_key_value_heads"), g("head_dim")
    Hk, Dk, Hv, Dv = g("linear_num_key_heads"), g("linear_key_head_dim"), g("linear_num_value_heads"), g("linear_value_head_dim")
    C, K = 2 * Hk * Dk + Hv * Dv, g("linear_conv_kernel_dim")
    shapes = {"model.embed_tokens.weight": (g("vocab_size"), H), "model.norm.weight": (H,)}
    for i in range(g("num_hidden_layers")):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate.weight": (E, H), p + "mlp.shared_expert_gate.weight": (1, H)})
        shapes.update({f"{p}mlp.shared_expert.{n}_proj.weight": s for n, s in (("gate", (Is, H)), ("up", (Is, H)), ("down", (H, Is)))})
        for e in range(E):
            shapes.update({f"{p}mlp.experts.{e}.{n}_proj.weight": s for n, s in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))})
        if i % 2 == 0:          # a GDN layer, then an attention layer
            a = p + "linear_attn."
            split = {"in_proj_qkv.weight": (C, H), "in_proj_z.weight": (Hv * Dv, H), "in_proj_b.weight": (Hv, H),
                     "in_proj_a.weight": (Hv, H)}
            packed = {"in_proj_qkvz.weight": (C + Hv * Dv, H), "in_proj_ba.weight": (2 * Hv, H)}
            shapes.update({a + n: s for n, s in (packed if "full_attention_interval" in cfg else split).items()})
            shapes.update({a + "conv1d.weight": (C, 1, K), a + "A_log": (Hv,), a + "dt_bias": (Hv,),
                           a + "norm.weight": (Dv,), a + "out_proj.weight": (H, Hv * Dv)})
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * Hq * D, H), a + "k_proj.weight": (G * D, H),
                           a + "v_proj.weight": (G * D, H), a + "o_proj.weight": (H, Hq * D),
                           a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
    return {n: (rng.standard_normal(s) * (0.05 if len(s) > 1 else 0.1)).astype(np.float32) for n, s in shapes.items()}


GDN_CONVERTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                 "in_proj_z", "in_proj_qkvz", "out_proj")     # in_proj_b / _a / _ba left dense, as a release may


def write_fp8_gdn_pair(root: Path, arch: str) -> tuple[Path, Path]:
    cfg = gdn_config(arch)
    tensors = gdn_tensors(cfg)
    converted = [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in GDN_CONVERTED]
    return write_pair(root, cfg, tensors, converted, skip=("lm_head", "model.embed_tokens", "mlp.gate",
                                                           "shared_expert_gate", "in_proj_b", "in_proj_a", "in_proj_ba"))
