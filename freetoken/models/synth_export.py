"""Write a ``synth:SPEC`` model (models/synth.py) as a Hugging Face Qwen3-MoE directory, so tools
that read files (llama.cpp's converter, transformers) see the very weights FreeToken generates.
``python -m freetoken demo-model DIR --synth SPEC``; pairs: bench/compare_llamacpp.py.

bf16 safetensors with the per-expert HF names, config.json from ``SynthShape.hf_config()``, the
synth tokenizer's files; shards with an index when one file (SHARD_BYTES) is not enough.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from freetoken.config import ConfigError

SHARD_BYTES = 4 << 30   # HF-style shards: large enough to be few, small enough to copy around


def export_synth(spec: str, out_dir, log=None, shard_bytes: int | None = None) -> Path:
    """Write synth:``spec`` (a Qwen3-MoE or gpt-oss preset, not a hybrid) to ``out_dir``, in shards of
    at most ``shard_bytes`` (default SHARD_BYTES); returns the path."""
    from freetoken.models.demo import synth_tokenizer_dir
    from freetoken.models.synth import PRESETS, parse_spec, synth_model
    from freetoken.models.synth_gpt_oss import PRESETS as GPT_OSS
    spec = spec.removeprefix("synth:")
    name, shape, _ = parse_spec(spec)
    if name not in PRESETS and name not in GPT_OSS:
        raise ConfigError(f"synth:{spec} is a hybrid; the Qwen3-MoE and gpt-oss presets "
                          f"({', '.join([*PRESETS, *GPT_OSS])}) can be exported")
    cfg, weights = synth_model(spec, log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = gpt_oss_tensors(cfg, weights) if name in GPT_OSS else hf_tensors(cfg, weights)
    _write_shards(out, tensors, shard_bytes or SHARD_BYTES)
    (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(synth_tokenizer_dir() / name, out / name)   # not the (read-only) mode
    return out


def hf_tensors(cfg, weights) -> dict:
    """HF Qwen3-MoE name -> uint16 (bf16) view of a FreeToken ModelWeights; no copies."""
    D, I = cfg.head_dim, cfg.moe_intermediate_size
    q_rows, kv_rows = cfg.num_heads * D, cfg.num_kv_heads * D
    t = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm,
         "lm_head.weight": weights.lm_head}
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": lw.input_norm,
                  p + "post_attention_layernorm.weight": lw.post_norm,
                  # qkv holds q rows, then k rows, then v rows (weights.LayerWeights)
                  p + "self_attn.q_proj.weight": lw.qkv[:q_rows],
                  p + "self_attn.k_proj.weight": lw.qkv[q_rows:q_rows + kv_rows],
                  p + "self_attn.v_proj.weight": lw.qkv[q_rows + kv_rows:],
                  p + "self_attn.o_proj.weight": lw.o_proj,
                  p + "self_attn.q_norm.weight": lw.q_norm, p + "self_attn.k_norm.weight": lw.k_norm,
                  p + "mlp.gate.weight": lw.router})
        for e in range(lw.gate_up.shape[0]):       # gate_up [E, 2I, H]: gate rows first
            q = f"{p}mlp.experts.{e}."
            t.update({q + "gate_proj.weight": lw.gate_up[e, :I], q + "up_proj.weight": lw.gate_up[e, I:],
                      q + "down_proj.weight": lw.down[e]})
    return t


def gpt_oss_tensors(cfg, weights) -> dict:
    """HF gpt-oss names -> arrays as the hub stores them: bf16 linears and norms, fp32 biases and
    sinks, the experts' MXFP4 blocks and exponents with gate and up rows interleaved again."""
    D, I = cfg.head_dim, cfg.moe_intermediate_size
    q_rows, kv_rows = cfg.num_heads * D, cfg.num_kv_heads * D
    t = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm,
         "lm_head.weight": weights.lm_head}
    for i, lw in enumerate(weights.layers):
        p, a, x = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.experts."
        interleaved = np.stack([np.arange(I), np.arange(I) + I], axis=1).reshape(-1)   # gate 0, up 0, gate 1, ...
        t |= {p + "input_layernorm.weight": lw.input_norm, p + "post_attention_layernorm.weight": lw.post_norm,
              a + "o_proj.weight": lw.o_proj, a + "o_proj.bias": lw.o_bias, a + "sinks": lw.sinks,
              p + "mlp.router.weight": lw.router, p + "mlp.router.bias": lw.router_bias,
              x + "gate_up_proj_bias": lw.gate_up_bias[:, interleaved], x + "down_proj_bias": lw.down_bias}
        for name, rows in (("q", slice(0, q_rows)), ("k", slice(q_rows, q_rows + kv_rows)),
                           ("v", slice(q_rows + kv_rows, None))):
            t |= {a + f"{name}_proj.weight": lw.qkv[rows], a + f"{name}_proj.bias": lw.qkv_bias[rows]}
        for name, bank, order in (("gate_up_proj", lw.gate_up, interleaved), ("down_proj", lw.down, None)):
            t[x + name + "_blocks"], t[x + name + "_scales"] = _hub_mxfp4(bank, order)
    return t


def _hub_mxfp4(bank: np.ndarray, row_order=None) -> tuple[np.ndarray, np.ndarray]:
    """mxfp4 blocks u8[E, R, NB, 17] (value j, j+16 in byte 1+j) -> the hub's u8[E, R, NB, 16]
    (values 2i, 2i+1 in byte i) and exponents u8[E, R, NB]; the inverse of gpt_oss_weights' reading."""
    blocks, scales = np.empty(bank.shape[:-1] + (16,), np.uint8), np.empty(bank.shape[:-1], np.uint8)
    for e in range(bank.shape[0]):
        b = bank[e] if row_order is None else bank[e][row_order]
        codes = np.concatenate([b[..., 1:] & 15, b[..., 1:] >> 4], axis=-1)
        blocks[e], scales[e] = codes[..., 0::2] | (codes[..., 1::2] << 4), b[..., 0]
    return blocks, scales


def _write_shards(out: Path, tensors: dict, shard_bytes: int) -> None:
    from freetoken.models.weights import save_safetensors
    shards, size = [{}], 0
    for name, arr in tensors.items():
        if size and size + arr.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_safetensors(out / "model.safetensors", shards[0])
        return
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for shard, fname in zip(shards, files):
        save_safetensors(out / fname, shard)
    weight_map = {name: fname for shard, fname in zip(shards, files) for name in shard}
    total = sum(a.nbytes for a in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
