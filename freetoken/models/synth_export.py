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

from freetoken.config import ConfigError

SHARD_BYTES = 4 << 30   # HF-style shards: large enough to be few, small enough to copy around


def export_synth(spec: str, out_dir, log=None, shard_bytes: int | None = None) -> Path:
    """Write synth:``spec`` (a Qwen3-MoE preset: not a hybrid, not gpt-oss) to ``out_dir``, in shards of at most
    ``shard_bytes`` (default SHARD_BYTES); returns the path."""
    from freetoken.models.demo import synth_tokenizer_dir
    from freetoken.models.synth import PRESETS, parse_spec, synth_model
    spec = spec.removeprefix("synth:")
    name, shape, _ = parse_spec(spec)
    if name not in PRESETS:
        raise ConfigError(f"synth:{spec} is not a Qwen3-MoE preset; only those ({', '.join(PRESETS)}) "
                          "can be exported so far")
    cfg, weights = synth_model(spec, log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, hf_tensors(cfg, weights), shard_bytes or SHARD_BYTES)
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
        save_safetensors(out / "model.safetensors", shards[0], "BF16")
        return
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for shard, fname in zip(shards, files):
        save_safetensors(out / fname, shard, "BF16")
    weight_map = {name: fname for shard, fname in zip(shards, files) for name in shard}
    total = sum(a.nbytes for a in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
