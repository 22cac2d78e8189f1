"""A GGUF model as llama.cpp's converter writes it -> ModelConfig and ModelWeights (Qwen3-MoE,
`qwen3moe`). The config comes from the file's metadata through the same mapping as a config.json
(models/hf_config.py); the tensors by llama.cpp's names into FreeToken's layout.

Quantized tensors stay in the file's blocks (kernels/qblocks.py; models/gguf_blocks.py reads
them): the routed experts as banks, the attention linears, the output head and the embedding
table, each read by ops that take blocks. Everything else (norms, the router, F16 tensors, a
dense-MLP layer) is widened exactly as gguf-py's `quants.dequantize` does: to bf16 when the file's
weights are bf16, else to float32. A quantized weight is defined as its gguf-py dequantization in
fp32, so every path computes what the spec computes. Every tensor's presence and shape is checked
before the first is read. The start-up log says what stays in blocks and what the widening costs.

Shape legend: L layers, E experts, I expert width, H hidden, Hq/G query/kv heads, D head dim, V vocab.
"""
from __future__ import annotations

import itertools

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models import registry
from freetoken.models.gguf_blocks import (block_format, expert_names, experts_stay_quantized, gate_up_layout,
                                         gate_up_names, quantized_banks, read_blocks, stacked_blocks)
from freetoken.models.gguf_file import GGUFError, GGUFModel
from freetoken.models.weights import LayerWeights, ModelWeights, load_layers, row_slices


def gguf_config(model: GGUFModel) -> ModelConfig:
    """The ModelConfig of the file's metadata. llama.cpp's qwen3moe always renormalises the top-k
    router weights (every Qwen3-MoE release sets norm_topk_prob), so the file says nothing of it.
    A layer without a router (ffn_gate_inp) is a dense-MLP layer."""
    from freetoken.models.hf_config import model_config_from_dict
    arch, need = model.architecture, model.require
    if registry.from_gguf(arch) is None:
        raise GGUFError(f"{model.paths[0]}: architecture {arch!r}; FreeToken reads GGUF "
                        f"{registry.gguf_supported()} (more families: the HF checkpoint)")
    layers = int(need("block_count"))
    hf = {**hf_config_keys(model, layers),
          "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in model.tensors]}
    return model_config_from_dict(hf)


def hf_config_keys(model: GGUFModel, layers: int) -> dict:
    """The config.json keys every family's GGUF metadata gives the same way (the families add theirs):
    sizes, attention, rope, experts; top-k renormalised (llama.cpp always does)."""
    key, need = model.key, model.require
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    hf = {"architectures": [registry.from_gguf(model.architecture)],
          "vocab_size": len(need("tokenizer.ggml.tokens", of_architecture=False)),
          "hidden_size": hidden, "num_hidden_layers": layers,
          "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
          "head_dim": int(key("attention.key_length", hidden // heads)),
          "rms_norm_eps": metadata_float(key("attention.layer_norm_rms_epsilon", 1e-6)),
          "rope_theta": metadata_float(key("rope.freq_base", 10000.0)),
          "max_position_embeddings": int(key("context_length", 32768)),
          "tie_word_embeddings": "output.weight" not in model.tensors,
          "num_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
          "moe_intermediate_size": int(need("expert_feed_forward_length")),
          "intermediate_size": int(key("feed_forward_length", need("expert_feed_forward_length"))),
          "norm_topk_prob": True, "torch_dtype": "bfloat16" if model.bf16 else "float32"}
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none":
        hf["rope_scaling"] = {"rope_type": scaling, "factor": metadata_float(key("rope.scaling.factor", 1.0))}
        extra = {"original_max_position_embeddings": ("rope.scaling.original_context_length", int),     # YaRN's
                 "beta_fast": ("rope.scaling.yarn_beta_fast", metadata_float),
                 "beta_slow": ("rope.scaling.yarn_beta_slow", metadata_float)}
        hf["rope_scaling"] |= {name: kind(key(k)) for name, (k, kind) in extra.items() if key(k) is not None}
    return hf


def gguf_weights(model: GGUFModel, cfg: ModelConfig, log=None) -> ModelWeights:
    """ModelWeights of the file, every tensor widened to the model dtype (gguf_config's torch_dtype)."""
    layout = expected_tensors(cfg, model)
    check_tensors(model, layout)
    read = TensorReader(model, np.dtype(np.uint16) if model.bf16 else np.dtype(np.float32), layout)
    widen_why = experts_stay_quantized(model, cfg) if cfg.moe_layers else "no MoE layers"
    read.quantized_experts = not widen_why
    if log is not None and cfg.moe_layers:
        types = "/".join(sorted(expert_types(model, cfg)))
        log.info("GGUF experts %s", f"({types}) loaded as {read.dtype.name.replace('uint16', 'bf16')}: {widen_why}"
                 if widen_why else f"kept in the file's blocks ({types})")
    embed = read.kept("token_embd.weight")
    lm_head = embed if cfg.tie_word_embeddings else read.kept("output.weight")
    layers = load_layers(lambda i: _layer(read, cfg, i), cfg.num_layers)
    kept = read.blocks_of | ({n for i in cfg.moe_layers for n in expert_names(model, i)} if read.quantized_experts
                             else set())
    widened = {t.type_name for n, t in model.tensors.items() if n not in kept} - {"F32", "BF16"}
    if log is not None:
        log.info("GGUF: %d tensors kept in their blocks, %s widened to %s at load: %s in memory for a %s file",
                 len(kept), "/".join(sorted(widened)) or "none", "bf16" if model.bf16 else "f32", size_text(read.nbytes),
                 size_text(sum(t.data.nbytes for t in model.tensors.values())))
    return ModelWeights(embed=embed, final_norm=read("output_norm.weight"), lm_head=lm_head, layers=layers)


def expert_types(model: GGUFModel, cfg: ModelConfig) -> set[str]:
    return {model.tensors[n].type_name for i in cfg.moe_layers for n in expert_names(model, i)}


def qkv_names(model: GGUFModel, p: str, split: list[str]) -> list[str]:
    """An attention layer's q, k, v tensors: one attn_qkv (the converter's --fuse-qkv: q, k, v
    rows stacked, FreeToken's own layout) or the three."""
    fused = f"{p}attn_qkv.weight"
    return [fused] if fused in model.tensors else split


def expected_tensors(cfg: ModelConfig, model: GGUFModel) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by llama.cpp's name, with its shape (numpy order)."""
    V, H, D, Hq, G = cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    out = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out.update(qkv_layout(model, p, (Hq * D, G * D, G * D), H))
        out.update({p + "attn_norm.weight": (H,), p + "ffn_norm.weight": (H,),
                    p + "attn_output.weight": (H, Hq * D), p + "attn_q_norm.weight": (D,),
                    p + "attn_k_norm.weight": (D,)})
        if cfg.is_moe_layer(i):
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            out.update({p + "ffn_gate_inp.weight": (E, H), **gate_up_layout(model, p, E, I, H),
                        p + "ffn_down_exps.weight": (E, H, I)})
        else:
            I = cfg.intermediate_size
            out.update({p + "ffn_gate.weight": (I, H), p + "ffn_up.weight": (I, H), p + "ffn_down.weight": (H, I)})
    return out


def qkv_layout(model: GGUFModel, p: str, rows: tuple[int, int, int], H: int) -> dict:
    """{name: shape} of an attention layer's q, k, v (qkv_names) of `rows` rows each."""
    names = qkv_names(model, p, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
    return {names[0]: (sum(rows), H)} if len(names) == 1 else {n: (r, H) for n, r in zip(names, rows)}


def check_tensors(model: GGUFModel, layout: dict) -> None:
    """Every tensor present and of the shape the config implies, before any is widened."""
    for name, shape in layout.items():
        t = model.tensors.get(name)
        if t is None:
            raise GGUFError(f"{model.paths[0]}: tensor {name} is missing")
        if t.shape[:-1] != shape[:-1] or _values_per_row(t) != shape[-1]:
            raise GGUFError(f"{t.file}: tensor {name} holds {t.shape[:-1] + (_values_per_row(t),)} values, "
                            f"the config implies {shape}")


def _values_per_row(t) -> int:
    """Values in a row of t: GGUF's ne0 (the block layout stores it as bytes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]]
    return t.data.shape[-1] // nbytes * block if t.data.dtype == np.uint8 else t.data.shape[-1]


class TensorReader:
    """name -> the tensor widened (gguf-py) to the model dtype, into `out` when given; counts bytes."""

    def __init__(self, model: GGUFModel, dtype: np.dtype, layout: dict):
        self.model, self.dtype, self.layout, self.nbytes = model, dtype, layout, 0
        self.quantized_experts = False      # gguf_weights: the routed experts stay in their blocks
        self.blocks_of: set[str] = set()    # the dense tensors kept in their blocks

    def kept(self, name: str) -> np.ndarray:
        """The tensor in the file's blocks when it is quantized (kernels/qblocks.py), else widened."""
        t = self.model.tensors[name]
        if block_format(t) is None:
            return self(name)
        self.blocks_of.add(name)
        return self.counted(read_blocks(t))

    def f32(self, name: str) -> np.ndarray:
        """The tensor widened to float32 whatever the model dtype (norms, biases, sinks: fp32 in the model)."""
        if self.dtype == np.float32:
            return self(name)
        return self.counted(TensorReader(self.model, np.dtype(np.float32), self.layout)(name))

    def counted(self, arrays):
        """arrays (one or a tuple), their bytes added to the loaded total."""
        self.nbytes += sum(a.nbytes for a in (arrays if isinstance(arrays, tuple) else (arrays,)))
        return arrays

    def __call__(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants
        from freetoken.kernels._bf16 import from_f32
        t = self.model.tensors[name]
        if self.dtype == np.uint16 and t.type_name == "BF16":
            values = t.data.view(np.uint16).reshape(self.layout[name])      # stored as the model keeps it
        else:
            values = quants.dequantize(t.data, GGMLQuantizationType[t.type_name]).astype(np.float32, copy=False)
            values = from_f32(values) if self.dtype == np.uint16 else values
        if out is None:
            out = np.array(values, dtype=self.dtype)                         # off the memory map
            self.nbytes += out.nbytes
        else:
            out[...] = values
        return out


def _layer(read: TensorReader, cfg: ModelConfig, i: int) -> LayerWeights:
    """One layer; the stacked arrays (qkv, gate_up) are filled in place, not concatenated."""
    p, H, D, Hq, G = f"blk.{i}.", cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qkv = stacked_qkv(read, qkv_names(read.model, p, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
                      ((Hq + 2 * G) * D, H))
    if cfg.is_moe_layer(i):
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        router = read(p + "ffn_gate_inp.weight")
        if read.quantized_experts:
            gate_up, down = read.counted(quantized_banks(read.model, p, E, I))
        else:
            gate_up = stacked_widened(read, gate_up_names(read.model, p), (E, 2 * I, H), 1)
            down = read(p + "ffn_down_exps.weight")
    else:
        I = cfg.intermediate_size
        router = None
        gate_up = stacked_widened(read, [p + "ffn_gate.weight", p + "ffn_up.weight"], (2 * I, H), 0)[None]
        down = read(p + "ffn_down.weight")[None]
    return LayerWeights(input_norm=read(p + "attn_norm.weight"), post_norm=read(p + "ffn_norm.weight"),
                        qkv=qkv, o_proj=read.kept(p + "attn_output.weight"), q_norm=read(p + "attn_q_norm.weight"),
                        k_norm=read(p + "attn_k_norm.weight"), router=router, gate_up=gate_up, down=down)


def stacked_qkv(read: TensorReader, names: list[str], shape: tuple[int, int]):
    """q, k and v stacked: in one array of blocks when they share a block format; as a tuple of
    parts (linear's stacked form) when they are quantized in different ones (Q4_K_M keeps some
    layers' v in Q6_K), neighbours of one format in one part (q|k, v: two GEMV calls a step, not
    three); widened into one array when none is quantized."""
    tensors = [read.model.tensors[n] for n in names]
    if all(block_format(t) is None for t in tensors):
        return stacked_widened(read, names, shape, 0)
    parts = []
    for _, run in itertools.groupby(zip(names, tensors), key=lambda nt: block_format(nt[1])):
        run_names, run_tensors = zip(*run)
        one = stacked_blocks(list(run_tensors)) if len(run_names) > 1 else None
        if one is None:
            parts += [read.kept(n) for n in run_names]
        else:
            read.blocks_of.update(run_names)
            parts.append(read.counted(one))
    return parts[0] if len(parts) == 1 else tuple(parts)


def stacked_widened(read: TensorReader, names: list[str], shape: tuple[int, ...], axis: int) -> np.ndarray:
    """The tensors stacked along `axis` of one array of `shape`, each widened into its slice."""
    out = np.empty(shape, read.dtype)
    read.nbytes += out.nbytes
    sizes = [read.layout[n][axis] for n in names]
    for name, rows in zip(names, row_slices(*sizes)):
        read(name, out[(slice(None),) * axis + (rows,)])
    return out


def size_text(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def metadata_float(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))
