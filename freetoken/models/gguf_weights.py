"""A GGUF model as llama.cpp's converter writes it -> ModelConfig and ModelWeights (Qwen3-MoE,
`qwen3moe`). The config comes from the file's metadata through the same mapping as a config.json
(models/hf_config.py); the tensors by llama.cpp's names into FreeToken's layout.

This version widens every tensor at load, exactly as gguf-py's `quants.dequantize` does: to bf16
when the file's weights are bf16, else to float32 (F16 and every quantized type; a quantized
weight is defined as its gguf-py dequantization in fp32, so the widened model computes what the
spec computes). The start-up log says how many bytes that costs against the file. Keeping the
experts quantized (host banks, GPU slots and fetches in the file's blocks) is the next step.

Shape legend: L layers, E experts, I expert width, H hidden, Hq/G query/kv heads, D head dim, V vocab.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.kernels._bf16 import from_f32
from freetoken.models.gguf_file import GGUFError, GGUFModel
from freetoken.models.weights import LayerWeights, ModelWeights, load_layers

ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM"}     # GGUF general.architecture -> HF architecture


def gguf_config(model: GGUFModel) -> ModelConfig:
    """The ModelConfig of the file's metadata. llama.cpp's qwen3moe always renormalises the top-k
    router weights (every Qwen3-MoE release sets norm_topk_prob), so the file says nothing of it."""
    from freetoken.models.hf_config import model_config_from_dict
    arch, key = model.architecture, model.key
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{model.paths[0]}: architecture {arch!r}; FreeToken reads GGUF "
                        f"{', '.join(ARCHITECTURES)} (more families: the HF checkpoint)")
    heads = int(key("attention.head_count"))
    scaling = key("rope.scaling.type")
    hf = {"architectures": [ARCHITECTURES[arch]],
          "vocab_size": len(model.metadata["tokenizer.ggml.tokens"]),
          "hidden_size": int(key("embedding_length")), "num_hidden_layers": int(key("block_count")),
          "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
          "head_dim": int(key("attention.key_length", int(key("embedding_length")) // heads)),
          "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
          "rope_theta": _f32(key("rope.freq_base", 10000.0)),
          "max_position_embeddings": int(key("context_length", 32768)),
          "tie_word_embeddings": "output.weight" not in model.tensors,
          "num_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
          "moe_intermediate_size": int(key("expert_feed_forward_length")),
          "intermediate_size": int(key("feed_forward_length", key("expert_feed_forward_length"))),
          "norm_topk_prob": True, "torch_dtype": "bfloat16"}
    if scaling and scaling != "none":
        hf["rope_scaling"] = {"rope_type": scaling, "factor": _f32(key("rope.scaling.factor", 1.0))}
    return model_config_from_dict(hf)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def gguf_weights(model: GGUFModel, cfg: ModelConfig, log=None) -> ModelWeights:
    """ModelWeights of the file, every tensor widened to the model dtype."""
    widened = {t.type_name for t in model.tensors.values()} - {"F32"}
    bf16 = sum(t.data.nbytes for t in model.tensors.values() if t.type_name == "BF16")
    dtype = np.dtype(np.uint16) if 2 * bf16 > sum(t.data.nbytes for t in model.tensors.values()) else np.dtype(np.float32)
    read = _Reader(model, dtype)
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = read("token_embd.weight", (V, H))
    lm_head = embed if cfg.tie_word_embeddings else read("output.weight", (V, H))
    layers = load_layers(lambda i: _layer(read, cfg, i), cfg.num_layers)
    if log is not None and widened - {"BF16"}:
        size = sum(t.data.nbytes for t in model.tensors.values())
        log.info("GGUF %s tensors widened to %s at load: %s in memory for a %s file",
                 "/".join(sorted(widened)), "bf16" if dtype == np.uint16 else "f32", _size(read.nbytes), _size(size))
    return ModelWeights(embed=embed, final_norm=read("output_norm.weight", (H,)), lm_head=lm_head, layers=layers)


class _Reader:
    """name, shape -> the tensor dequantized (gguf-py) in the model dtype; counts the bytes made."""

    def __init__(self, model: GGUFModel, dtype: np.dtype):
        self.model, self.dtype, self.nbytes = model, dtype, 0

    def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants
        t = self.model.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.model.paths[0]}: tensor {name} is missing")
        try:
            values = quants.dequantize(t.data, GGMLQuantizationType[t.type_name])
        except (ValueError, TypeError) as e:
            raise GGUFError(f"{t.file}: tensor {name} ({t.type_name}) cannot be read: {e}") from None
        if values.shape != shape:
            raise GGUFError(f"{t.file}: tensor {name} has shape {values.shape}, the config implies {shape}")
        out = from_f32(values.astype(np.float32)) if self.dtype == np.uint16 else values.astype(np.float32)
        self.nbytes += out.nbytes
        return np.ascontiguousarray(out)


def _layer(read: _Reader, cfg: ModelConfig, i: int) -> LayerWeights:
    p, H, D, Hq, G = f"blk.{i}.", cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qkv = np.concatenate([read(f"{p}attn_q.weight", (Hq * D, H)), read(f"{p}attn_k.weight", (G * D, H)),
                          read(f"{p}attn_v.weight", (G * D, H))])
    if cfg.is_moe_layer(i):
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        router = read(f"{p}ffn_gate_inp.weight", (E, H))
        gate_up = np.concatenate([read(f"{p}ffn_gate_exps.weight", (E, I, H)),
                                  read(f"{p}ffn_up_exps.weight", (E, I, H))], axis=1)   # [E, 2I, H]
        down = read(f"{p}ffn_down_exps.weight", (E, H, I))
    else:
        I = cfg.intermediate_size
        router = None
        gate_up = np.concatenate([read(f"{p}ffn_gate.weight", (I, H)), read(f"{p}ffn_up.weight", (I, H))])[None]
        down = read(f"{p}ffn_down.weight", (H, I))[None]
    return LayerWeights(input_norm=read(f"{p}attn_norm.weight", (H,)), post_norm=read(f"{p}ffn_norm.weight", (H,)),
                        qkv=qkv, o_proj=read(f"{p}attn_output.weight", (H, Hq * D)),
                        q_norm=read(f"{p}attn_q_norm.weight", (D,)), k_norm=read(f"{p}attn_k_norm.weight", (D,)),
                        router=router, gate_up=gate_up, down=down)
