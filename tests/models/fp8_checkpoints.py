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
    dense, fp8, tags = {}, {}, {}
    for name, w in random_tensors(cfg, seed=3, std=0.05).items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            codes, scales = quantize(w, scale_dtype)
            full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
            dense[name] = e4m3_table()[codes] * full
            fp8[name], fp8[name + "_scale_inv"] = codes, scales
            tags[name], tags[name + "_scale_inv"] = "F8_E4M3", "BF16" if scale_dtype == "bfloat16" else "F32"
        else:
            dense[name] = fp8[name] = w
            tags[name] = "F32"
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "modules_to_not_convert": ["lm_head", "model.embed_tokens", "mlp.gate"]}
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
