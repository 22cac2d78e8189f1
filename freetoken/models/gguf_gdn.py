"""A GGUF file of a Gated DeltaNet hybrid as llama.cpp's converter writes it (conversion/qwen.py:
Qwen3NextModel for `qwen3next`, Qwen3_5MoeTextModel for `qwen35moe`) -> ModelConfig and the
ModelWeights of GdnLayerWeights that models/hf_gdn.py builds from the HF checkpoint.

Metadata (`<arch>.` keys): ssm.group_count Hk, ssm.time_step_rank Hv, ssm.state_size Dk,
ssm.inner_size Hv*Dv, ssm.conv_kernel K; attention.recurrent_layers (one bool a block; written when
config.json lists layer_types), else full_attention_interval (layer i is full attention when
(i + 1) % n == 0; 4 when absent, as llama.cpp reads it); rope.dimension_count = int(head_dim *
partial_rotary_factor); expert_shared_feed_forward_length Is. block_count includes the
nextn_predict_layers multi-token-prediction blocks at the end: not read (hf_gdn skips mtp.*).
qwen35moe's rope.dimension_sections (MRoPE) rotate text like plain RoPE (one position for all three).
llama.cpp always renormalises the top-k router weights and maps no dense-MLP layer for either
family, so a file means norm_topk_prob true and experts in every layer.

Each converter step per tensor, and how it is undone here:
- The (1 + w) RMSNorms (attn_norm, post_attention_norm, output_norm, attn_q/k_norm) are stored as
  1 + w (added in fp32 for a bf16 or fp32 checkpoint): the factor hf_gdn folds in the same way, so
  used as stored (float32). ssm_norm (the GDN output norm, applied as w) is stored as is.
- A_log is stored as ssm_a = -exp(A_log): A_log = log(-ssm_a), in float64, kept float32.
- dt_bias is renamed ssm_dt.bias; conv1d [C, 1, K] is squeezed to ssm_conv1d [C, K].
- Qwen3-Next's in_proj_qkvz (rows per key head [q | k | v | z]) is split into attn_qkv [all q |
  all k | all v] and attn_gate [all z]: FreeToken's own row order. in_proj_ba is stored unchanged
  as ssm_ba (rows per key head [b (r) | a (r)]): its rows are gathered into [all b | all a].
- Qwen3.5: in_proj_qkv, _z, _b, _a become attn_qkv, attn_gate, ssm_beta, ssm_alpha. When Hv != Hk
  the converter re-orders the value heads from grouped (head g*r + j at g*r + j) to tiled (at
  j*Hk + g) in attn_qkv's v rows, attn_gate's rows, ssm_beta/alpha's rows, ssm_a, ssm_dt,
  ssm_conv1d's v channels and ssm_out's columns: the inverse gather is applied to each.
- Unchanged but renamed: attention q_proj (per head [query | gate]), k, v, o_proj -> attn_q, _k,
  _v, _output; experts stacked into ffn_{gate,up,down}_exps; the router -> ffn_gate_inp; the shared
  expert -> ffn_{gate,up,down}_shexp and its gate -> ffn_gate_inp_shexp [1, H].

In the file's blocks (kernels/qblocks.py), as gguf_weights keeps them: the embedding, output, attn_q/
k/v, attn_output, the routed experts; and here also the shared expert (a one-expert bank, when its
gate and up share a block format and its down is one), in_proj = [attn_qkv | attn_gate | b | a]
(one array when the parts share a format, else the linear op's tuple of parts; row gathers move
whole rows, which every block format quantizes independently) and ssm_out (its column gather moves
whole heads of Dv values: kept when Dv is a multiple of the block's values, as Q8_0's 32 with
Dv 128; otherwise, K-quants or a Dv of 24, ssm_out is widened). Widened as gguf-py's
`quants.dequantize` does: routers, ssm_conv1d and ssm_norm to the model dtype (bf16 for a bf16 file,
else fp32); norms, A_log and dt_bias to float32.
Shape legend as models/gdn_weights.py; r = Hv / Hk value heads per key head.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from freetoken.models.gdn_weights import GdnLayerWeights
from freetoken.models.gguf_blocks import (block_format, expert_names, experts_stay_quantized, gate_up_layout,
                                         gate_up_names, quantized_banks, stacked_blocks)
from freetoken.models.gguf_file import GGUFError, GGUFModel
from freetoken.models.gguf_weights import (TensorReader, check_tensors, expert_types, hf_config_keys, qkv_layout,
                                           qkv_names, size_text, stacked_qkv, stacked_widened)
from freetoken.models.weights import ModelWeights, load_layers

F32 = np.dtype(np.float32)
QWEN3_NEXT = "qwen3next"      # the other family, qwen35moe, splits in_proj and tiles the value heads
QWEN35_MOE = "qwen35moe"
QWEN3_NEXT_LEGACY = "qwen3next (ssm_in)"   # not a GGUF name: the first converter's in_proj whole


def gdn_gguf_config(model: GGUFModel) -> ModelConfig:
    """The ModelConfig of the file's metadata, through the same mapping as a config.json."""
    from freetoken.models.hf_config import model_config_from_dict
    key, need = model.key, model.require
    layers = _text_layers(model)
    hf = hf_config_keys(model, layers)
    D, Hv = hf["head_dim"], int(need("ssm.time_step_rank"))
    hf |= {"layer_types": _layer_types(model, layers), "linear_num_key_heads": int(need("ssm.group_count")),
          "linear_num_value_heads": Hv, "linear_key_head_dim": int(need("ssm.state_size")),
          "linear_value_head_dim": _value_head_dim(model, Hv), "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
          "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length", 0)),
          "partial_rotary_factor": int(key("rope.dimension_count", D)) / D}
    return model_config_from_dict(hf)


def _text_layers(model: GGUFModel) -> int:
    """Decoder layers: block_count less the multi-token-prediction blocks after them."""
    return int(model.require("block_count")) - int(model.key("nextn_predict_layers", 0) or 0)


def _layer_types(model: GGUFModel, layers: int) -> list[str]:
    recurrent = model.key("attention.recurrent_layers")
    if recurrent is None:
        every = int(model.key("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    if len(recurrent) < layers:
        raise GGUFError(f"{model.paths[0]}: attention.recurrent_layers lists {len(recurrent)} of {layers} layers")
    return [LINEAR_ATTENTION if r else FULL_ATTENTION for r in list(recurrent)[:layers]]


def _value_head_dim(model: GGUFModel, Hv: int) -> int:
    inner = int(model.require("ssm.inner_size"))
    if Hv <= 0 or inner % Hv:
        raise GGUFError(f"{model.paths[0]}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {Hv}")
    return inner // Hv


def gdn_gguf_weights(model: GGUFModel, cfg: ModelConfig, log=None) -> ModelWeights:
    """ModelWeights of the file (GdnLayerWeights layers), every tensor checked before any is read."""
    arch = _variant(model)
    layout = gdn_tensors(cfg, arch, model)
    check_tensors(model, layout)
    read = _GdnReader(model, layout, _orders(cfg, arch))
    widen_why = experts_stay_quantized(model, cfg)
    read.quantized_experts = not widen_why
    embed = read.kept("token_embd.weight")
    lm_head = embed if cfg.tie_word_embeddings else read.kept("output.weight")
    layers = load_layers(lambda i: _layer(read, cfg, i), cfg.num_layers)
    weights = ModelWeights(embed=embed, final_norm=read.f32("output_norm.weight"), lm_head=lm_head, layers=layers)
    if log is not None:
        _log(log, read, cfg, widen_why)
    return weights


def _variant(model: GGUFModel) -> str:
    """The architecture, or QWEN3_NEXT_LEGACY for a Qwen3-Next file of the converter's first
    version: in_proj_qkvz whole as ssm_in (rows per key head [q | k | v | z], as the checkpoint
    stores it), which llama.cpp still loads."""
    if model.architecture == QWEN3_NEXT and any(n.endswith(".ssm_in.weight") for n in model.tensors):
        return QWEN3_NEXT_LEGACY
    return model.architecture


def gdn_tensors(cfg: ModelConfig, arch: str, model: GGUFModel) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by llama.cpp's name, with its shape (numpy order)."""
    V, H, E, I, Is = cfg.vocab_size, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    out = {"token_embd.weight": (V, H), "output_norm.weight": (H,)} | ({} if cfg.tie_word_embeddings
                                                                       else {"output.weight": (V, H)})
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (H,), p + "post_attention_norm.weight": (H,), p + "ffn_gate_inp.weight": (E, H),
                **gate_up_layout(model, p, E, I, H), p + "ffn_down_exps.weight": (E, H, I)}
        if Is:
            out |= {p + "ffn_gate_shexp.weight": (Is, H), p + "ffn_up_shexp.weight": (Is, H),
                    p + "ffn_down_shexp.weight": (H, Is), p + "ffn_gate_inp_shexp.weight": (1, H)}
        out |= _gdn_tensors(cfg, arch, p) if cfg.is_linear_layer(i) else _attention_tensors(cfg, p, model)
    return out


def _attention_tensors(cfg: ModelConfig, p: str, model: GGUFModel) -> dict:
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    return {**qkv_layout(model, p, (2 * Hq * D, G * D, G * D), H), p + "attn_output.weight": (H, Hq * D), p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)}


def _gdn_tensors(cfg: ModelConfig, arch: str, p: str) -> dict:
    H, Hv, Dv, C, K = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim, \
        cfg.linear_conv_kernel_dim
    ba = {p + "ssm_ba.weight": (2 * Hv, H)} if arch != QWEN35_MOE else \
        {p + "ssm_beta.weight": (Hv, H), p + "ssm_alpha.weight": (Hv, H)}
    qkvz = {p + "ssm_in.weight": (C + Hv * Dv, H)} if arch == QWEN3_NEXT_LEGACY else \
        {p + "attn_qkv.weight": (C, H), p + "attn_gate.weight": (Hv * Dv, H)}
    return {**qkvz, **ba, p + "ssm_a": (Hv,),
            p + "ssm_dt.bias": (Hv,), p + "ssm_conv1d.weight": (C, K), p + "ssm_norm.weight": (Dv,),
            p + "ssm_out.weight": (H, Hv * Dv)}


def _orders(cfg: ModelConfig, arch: str) -> dict[str, np.ndarray]:
    """Index arrays gathering the file's rows (ssm_out: columns) into FreeToken's order; a name
    absent: stored in that order already."""
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r = Hv // Hk
    if arch in (QWEN3_NEXT, QWEN3_NEXT_LEGACY):   # ssm_ba rows g*2r + s*r + j (s: 0 b, 1 a) -> s*Hv + g*r + j
        ba = np.arange(2 * Hv).reshape(Hk, 2, r).transpose(1, 0, 2).ravel()
        grouped = np.arange(Hk * (2 * Dk + 2 * r * Dv)).reshape(Hk, -1)    # ssm_in: per key head q|k|v|z
        cuts = np.cumsum([0, Dk, Dk, r * Dv, r * Dv])
        qkvz = np.concatenate([grouped[:, a:b].ravel() for a, b in zip(cuts[:-1], cuts[1:])])
        return {"ba": ba, "qkvz": qkvz}
    if r == 1:
        return {}
    heads = np.arange(Hv).reshape(r, Hk).T.ravel()     # value head g*r + j is stored at j*Hk + g
    v = (heads[:, None] * Dv + np.arange(Dv)).ravel()
    return {"heads": heads, "v": v, "qkv": np.concatenate([np.arange(2 * Hk * Dk), 2 * Hk * Dk + v])}


class _GdnReader(TensorReader):
    """gguf_weights' reader (model dtype, blocks kept) with float32 reads and the row orders."""

    def __init__(self, model: GGUFModel, layout: dict, orders: dict):
        super().__init__(model, np.dtype(np.uint16) if model.bf16 else F32, layout)
        self.orders = orders

    def gathered(self, name: str, order: str, widen: bool = False) -> np.ndarray:
        """Tensor `name` (kept in blocks unless `widen`) with its rows gathered by orders[order]."""
        w = self(name) if widen else self.kept(name)
        rows = self.orders.get(order)
        return w if rows is None else np.ascontiguousarray(w[rows])


def _layer(read: _GdnReader, cfg: ModelConfig, i: int) -> GdnLayerWeights:
    p = f"blk.{i}."
    mixer = _gdn(read, cfg, p) if cfg.is_linear_layer(i) else _attention(read, cfg, p)
    return GdnLayerWeights(input_norm=read.f32(p + "attn_norm.weight"),
                           post_norm=read.f32(p + "post_attention_norm.weight"), **mixer, **_mlp(read, cfg, p))


def _attention(read: _GdnReader, cfg: ModelConfig, p: str) -> dict:
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    names = qkv_names(read.model, p, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
    qkv = stacked_qkv(read, names, ((2 * Hq + 2 * G) * D, H))
    return dict(qkv=qkv, o_proj=read.kept(p + "attn_output.weight"), q_norm=read.f32(p + "attn_q_norm.weight"),
                k_norm=read.f32(p + "attn_k_norm.weight"))


def _gdn(read: _GdnReader, cfg: ModelConfig, p: str) -> dict:
    a = read.f32(p + "ssm_a")
    if (a >= 0).any():
        raise GGUFError(f"{read.model.paths[0]}: {p}ssm_a holds values >= 0; the converter writes -exp(A_log)")
    conv = read.gathered(p + "ssm_conv1d.weight", "qkv", widen=True)
    heads = read.orders.get("heads", slice(None))
    return dict(in_proj=_in_proj(read, p), conv=conv, out_proj=_out_proj(read, cfg, p),
                A_log=np.log(-a.astype(np.float64)).astype(np.float32)[heads],
                dt_bias=np.ascontiguousarray(read.f32(p + "ssm_dt.bias")[heads]), gdn_norm=read(p + "ssm_norm.weight"))


def _in_proj(read: _GdnReader, p: str):
    """[q, k, v | z | b | a] rows: one array when the parts are all dense or all blocks of one
    format, else a tuple of parts (the linear op computes each into its columns)."""
    if p + "ssm_in.weight" in read.layout:                  # QWEN3_NEXT_LEGACY
        parts = [read.gathered(p + "ssm_in.weight", "qkvz"), read.gathered(p + "ssm_ba.weight", "ba")]
    elif read.model.architecture == QWEN3_NEXT:
        parts = [read.kept(p + "attn_qkv.weight"), read.kept(p + "attn_gate.weight"),
                 read.gathered(p + "ssm_ba.weight", "ba")]
    else:
        parts = [read.gathered(p + "attn_qkv.weight", "qkv"), read.gathered(p + "attn_gate.weight", "v"),
                 read.gathered(p + "ssm_beta.weight", "heads"), read.gathered(p + "ssm_alpha.weight", "heads")]
    if len({(w.dtype, w.shape[1:]) for w in parts}) == 1:
        return np.concatenate(parts)
    return tuple(parts)


def _out_proj(read: _GdnReader, cfg: ModelConfig, p: str) -> np.ndarray:
    """ssm_out [H, Hv*Dv]; Qwen3.5's tiled value-head columns gathered back: in blocks when a
    head's Dv values are whole blocks, else widened."""
    name, heads = p + "ssm_out.weight", read.orders.get("heads")
    if heads is None:
        return read.kept(name)
    fmt, Dv = block_format(read.model.tensors[name]), cfg.linear_value_head_dim
    if fmt is None or Dv % fmt.values:
        return np.ascontiguousarray(read(name)[:, read.orders["v"]])
    per = Dv // fmt.values
    return np.ascontiguousarray(read.kept(name)[:, (heads[:, None] * per + np.arange(per)).ravel()])


def _mlp(read: _GdnReader, cfg: ModelConfig, p: str) -> dict:
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if read.quantized_experts:
        gate_up, down = read.counted(quantized_banks(read.model, p, E, I))
    else:
        gate_up = stacked_widened(read, gate_up_names(read.model, p), (E, 2 * I, H), 1)
        down = read(p + "ffn_down_exps.weight")
    shared = _shared_expert(read, cfg, p) if cfg.shared_expert_intermediate_size else {}
    return dict(router=read(p + "ffn_gate_inp.weight"), gate_up=gate_up, down=down, **shared)


def _shared_expert(read: _GdnReader, cfg: ModelConfig, p: str) -> dict:
    """The shared expert as a one-expert bank: its blocks when gate and up share a block format and
    down is one (the experts op reads blocks), else widened."""
    Is, H = cfg.shared_expert_intermediate_size, cfg.hidden_size
    names, down = [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"], p + "ffn_down_shexp.weight"
    gate_up = None
    if block_format(read.model.tensors[down]) is not None:
        gate_up = stacked_blocks([read.model.tensors[n] for n in names])
    if gate_up is None:
        gate_up, down_w = stacked_widened(read, names, (2 * Is, H), 0), read(down)
    else:
        read.blocks_of.update(names)
        gate_up, down_w = read.counted(gate_up), read.kept(down)
    return dict(shared_gate_up=gate_up[None], shared_down=down_w[None],
                shared_gate=read(p + "ffn_gate_inp_shexp.weight"))


def _log(log, read: _GdnReader, cfg: ModelConfig, widen_why: str) -> None:
    model = read.model
    types = "/".join(sorted(expert_types(model, cfg)))
    dtype = "bf16" if read.dtype == np.uint16 else "f32"
    log.info("GGUF experts %s", f"({types}) loaded as {dtype}: {widen_why}" if widen_why
             else f"kept in the file's blocks ({types})")
    kept = read.blocks_of | ({n for i in cfg.moe_layers for n in expert_names(model, i)} if read.quantized_experts
                             else set())
    widened = {model.tensors[n].type_name for n in read.layout if n not in kept} - {"F32", "BF16"}
    skipped = len(model.tensors) - len(read.layout)
    log.info("GGUF: %d tensors kept in their blocks, %s widened to %s at load: %s in memory%s", len(kept),
             "/".join(sorted(widened)) or "none", dtype, size_text(read.nbytes),
             f"; {skipped} multi-token-prediction tensors not loaded" if skipped else "")
