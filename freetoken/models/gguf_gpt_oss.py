"""A gpt-oss GGUF as llama.cpp's converter writes it (conversion/gpt_oss.py, architecture
`gpt-oss`) -> ModelConfig and the ModelWeights of GptOssLayerWeights that models/gpt_oss_weights.py
builds from the HF checkpoint.

Metadata: the keys every family shares (models/gguf_weights.hf_config_keys), the sliding window
(`attention.sliding_window`) and YaRN's original context and betas (`rope.scaling.*`). What the
file does not say, llama.cpp fixes for the architecture and so does this reader: every other layer
slides, from the first; the clamped SwiGLU's limit 7.0 and alpha 1.702; the router's top-k
renormalised. YaRN's correction range is not truncated (gpt-oss's config.json says
`truncate: false`; transformers follows it).

Each converter step per tensor, and how it is undone here:
- the interleaved gate_up experts (and their bias) are split into ffn_gate_exps and ffn_up_exps,
  stored transposed back to [E, I, H]: stacked into FreeToken's [E, 2I, H] bank, gate rows first;
- the hub's MXFP4 blocks are re-packed into GGUF's MXFP4 (kernels/qmxfp4.py's layout): kept in them;
- sinks become attn_sinks.weight; q/k/v/o, the router (ffn_gate_inp) and the experts keep their biases.
Biases and sinks are read as float32; norms and the router as the model dtype; the embedding, output,
attention linears and the experts stay in the file's blocks when quantized (as gguf_weights keeps them).

Shape legend: E experts, I expert width, H hidden, Hq / G query / kv heads, D head dim, V vocab.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.gguf_blocks import experts_stay_quantized, gate_up_layout, gate_up_names, quantized_banks
from freetoken.models.gguf_file import GGUFModel
from freetoken.models.gguf_weights import (TensorReader, check_tensors, expert_types, hf_config_keys, qkv_layout,
                                           qkv_names, size_text, stacked_qkv, stacked_widened)
from freetoken.models.gpt_oss_weights import GptOssLayerWeights
from freetoken.models.weights import ModelWeights, load_layers

F32 = np.dtype(np.float32)


def gpt_oss_gguf_config(model: GGUFModel) -> ModelConfig:
    """The ModelConfig of the file's metadata, through the same mapping as a config.json."""
    from freetoken.models.hf_config import model_config_from_dict
    hf = hf_config_keys(model, int(model.require("block_count")))
    hf["sliding_window"] = int(model.require("attention.sliding_window"))
    if "rope_scaling" in hf:
        hf["rope_scaling"]["truncate"] = False
    return model_config_from_dict(hf)


def gpt_oss_gguf_weights(model: GGUFModel, cfg: ModelConfig, log=None) -> ModelWeights:
    """ModelWeights of the file (gguf_weights.gguf_weights' rules for what stays in blocks)."""
    layout = _expected_tensors(cfg, model)
    check_tensors(model, layout)
    read = TensorReader(model, np.dtype(np.uint16) if model.bf16 else F32, layout)
    widen_why = experts_stay_quantized(model, cfg)
    read.quantized_experts = not widen_why
    embed = read.kept("token_embd.weight")
    lm_head = embed if cfg.tie_word_embeddings else read.kept("output.weight")
    layers = load_layers(lambda i: _layer(read, cfg, i), cfg.num_layers)
    if log is not None:
        types = "/".join(sorted(expert_types(model, cfg)))
        log.info("GGUF gpt-oss: experts (%s) %s; %s in memory for a %s file", types,
                 f"widened: {widen_why}" if widen_why else "kept in the file's blocks", size_text(read.nbytes),
                 size_text(sum(t.data.nbytes for t in model.tensors.values())))
    return ModelWeights(embed=embed, final_norm=read("output_norm.weight"), lm_head=lm_head, layers=layers)


def _expected_tensors(cfg: ModelConfig, model: GGUFModel) -> dict[str, tuple[int, ...]]:
    V, H, D, Hq, G = cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    out = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out |= qkv_layout(model, p, (Hq * D, G * D, G * D), H)
        out |= {p + "attn_q.bias": (Hq * D,), p + "attn_k.bias": (G * D,), p + "attn_v.bias": (G * D,),
                p + "attn_output.weight": (H, Hq * D), p + "attn_output.bias": (H,), p + "attn_sinks.weight": (Hq,),
                p + "attn_norm.weight": (H,), p + "post_attention_norm.weight": (H,),
                p + "ffn_gate_inp.weight": (E, H), p + "ffn_gate_inp.bias": (E,),
                **gate_up_layout(model, p, E, I, H), p + "ffn_down_exps.weight": (E, H, I),
                p + "ffn_gate_exps.bias": (E, I), p + "ffn_up_exps.bias": (E, I), p + "ffn_down_exps.bias": (E, H)}
    return out


def _layer(read: TensorReader, cfg: ModelConfig, i: int) -> GptOssLayerWeights:
    p, H, D, Hq, G = f"blk.{i}.", cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    split = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    if read.quantized_experts:
        gate_up, down = read.counted(quantized_banks(read.model, p, E, I))
    else:
        gate_up = stacked_widened(read, gate_up_names(read.model, p), (E, 2 * I, H), 1)
        down = read(p + "ffn_down_exps.weight")
    return GptOssLayerWeights(
        input_norm=read(p + "attn_norm.weight"), post_norm=read(p + "post_attention_norm.weight"),
        qkv=stacked_qkv(read, qkv_names(read.model, p, split), ((Hq + 2 * G) * D, H)),
        qkv_bias=np.concatenate([read.f32(p + f"attn_{x}.bias") for x in "qkv"]),
        o_proj=read.kept(p + "attn_output.weight"), o_bias=read.f32(p + "attn_output.bias"),
        sinks=read.f32(p + "attn_sinks.weight"),
        router=read(p + "ffn_gate_inp.weight"), router_bias=read.f32(p + "ffn_gate_inp.bias"),
        gate_up=gate_up, down=down, down_bias=read.f32(p + "ffn_down_exps.bias"),
        gate_up_bias=np.concatenate([read.f32(p + "ffn_gate_exps.bias"), read.f32(p + "ffn_up_exps.bias")], axis=1))

