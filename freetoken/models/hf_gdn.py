"""The Hugging Face loader of the Gated DeltaNet (GDN) models (Qwen3.5/3.6-MoE, with or without the
vision wrapper, and Qwen3-Next) into GdnLayerWeights (models/gdn_weights.py).

What it reconciles: Qwen3.5 stores the GDN projections apart (in_proj_qkv, _z, _b, _a), Qwen3-Next
packs them (in_proj_qkvz, in_proj_ba) grouped per key head, [q | k | v | z] and [b | a] within a
group; both become one in_proj with rows [q, k, v (all heads each) | z | b | a]. Experts stored
per expert or packed land in the same banks (weights.expert_banks). The Gemma-style norms store
w and scale by 1 + w: the factor is folded in here, kept in float32 (1 + w rounded to bf16 would
lose w's low bits). Vision (model.visual.*) and multi-token-prediction (mtp.*) weights are not
read: this build serves text.

Block FP8 (Qwen3.6-FP8, Qwen3-Next-FP8; models/fp8_weights.py): the linears a release converts
(attention q/k/v/o, the GDN in_proj parts and out_proj, the experts, the shared expert) stay in
FP8 row blocks when their K is a multiple of 128. Every re-arrangement here moves whole rows, and a
row block is a row, so the packed projections re-order the same way in blocks. Parts that cannot
share one array (some FP8, some not) become a tuple of parts, which the linear op writes into its
output's columns; a shared expert whose three projections are not all FP8 blocks is widened.
Shape legend as models/gdn_weights.py.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.fp8_weights import fp8_stacked, is_fp8, keeps_blocks
from freetoken.models.gdn_weights import GdnLayerWeights
from freetoken.models.weights import (Checkpoint, ModelWeights, dense_banks, expert_banks, load_layers, read_stacked,
                                      read_tensor)

F32 = np.dtype(np.float32)


def load_gdn(ck: Checkpoint, cfg: ModelConfig, dtype: np.dtype, log=None) -> ModelWeights:
    skipped = [n for n in ck.names() if n.startswith(("model.visual.", "visual.", "mtp."))]
    if skipped and log is not None:
        log.info("text only: %d vision / multi-token-prediction tensors are not loaded", len(skipped))
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = read_tensor(ck, "model.embed_tokens.weight", (V, H), dtype)
    lm_head = embed if cfg.tie_word_embeddings else read_tensor(ck, "lm_head.weight", (V, H), dtype)
    layers = load_layers(lambda i: _layer(ck, cfg, i, dtype), cfg.num_layers)
    return ModelWeights(embed=embed, final_norm=_norm(ck, "model.norm.weight", H), lm_head=lm_head, layers=layers)


def _norm(ck: Checkpoint, name: str, n: int) -> np.ndarray:
    """A Gemma-style norm's factor 1 + w, float32."""
    return (np.float32(1.0) + read_tensor(ck, name, (n,), F32)).astype(np.float32)


def _layer(ck: Checkpoint, cfg: ModelConfig, i: int, dtype) -> GdnLayerWeights:
    p, H = f"model.layers.{i}.", cfg.hidden_size
    mixer = _gdn(ck, cfg, p, dtype) if cfg.is_linear_layer(i) else _attention(ck, cfg, p, dtype)
    return GdnLayerWeights(input_norm=_norm(ck, f"{p}input_layernorm.weight", H),
                              post_norm=_norm(ck, f"{p}post_attention_layernorm.weight", H),
                              **mixer, **_mlp(ck, cfg, i, p, dtype))


def _attention(ck: Checkpoint, cfg: ModelConfig, p: str, dtype) -> dict:
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    names = [f"{p}self_attn.{proj}_proj.weight" for proj in "qkv"]
    qkv = _stacked(ck, names, [(2 * Hq * D, H), (G * D, H), (G * D, H)], dtype)
    return dict(qkv=qkv, o_proj=read_tensor(ck, f"{p}self_attn.o_proj.weight", (H, Hq * D), dtype),
                q_norm=_norm(ck, f"{p}self_attn.q_norm.weight", D), k_norm=_norm(ck, f"{p}self_attn.k_norm.weight", D))


def _gdn(ck: Checkpoint, cfg: ModelConfig, p: str, dtype) -> dict:
    H, Hv, Dv, C, K = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim, \
        cfg.linear_conv_kernel_dim
    q = f"{p}linear_attn."
    in_proj = _packed_in_proj(ck, cfg, q, dtype) if f"{q}in_proj_qkvz.weight" in ck else _split_in_proj(ck, cfg, q, dtype)
    return dict(in_proj=in_proj, conv=np.ascontiguousarray(read_tensor(ck, f"{q}conv1d.weight", (C, 1, K), dtype)[:, 0]),
                A_log=read_tensor(ck, f"{q}A_log", (Hv,), F32), dt_bias=read_tensor(ck, f"{q}dt_bias", (Hv,), F32),
                gdn_norm=read_tensor(ck, f"{q}norm.weight", (Dv,), dtype),
                out_proj=read_tensor(ck, f"{q}out_proj.weight", (H, Hv * Dv), dtype))


def _stacked(ck: Checkpoint, names: list[str], shapes: list[tuple[int, int]], dtype):
    """Linears stacked along their rows: FP8 row blocks when all are (fp8_stacked), else one dense
    array, or a tuple of the FP8 run and the dense run when the checkpoint converted only some
    (Qwen3.6-FP8 may leave the small in_proj_b / _a dense)."""
    fp8 = [is_fp8(ck, n) and keeps_blocks(s) for n, s in zip(names, shapes)]
    if all(fp8):
        return fp8_stacked(ck, names, shapes)
    k = fp8.index(False)
    if any(fp8) and not any(fp8[k:]):            # an FP8 run, then the rest dense: two parts
        return (fp8_stacked(ck, names[:k], shapes[:k]), read_stacked(ck, names[k:], shapes[k:], dtype))
    return read_stacked(ck, names, shapes, dtype)


def _split_in_proj(ck: Checkpoint, cfg: ModelConfig, q: str, dtype):
    """Qwen3.5: in_proj_qkv [C, H], in_proj_z [Hv*Dv, H], in_proj_b / in_proj_a [Hv, H], stacked."""
    H, Hv, Dv, C = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim
    names = [f"{q}{name}.weight" for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    return _stacked(ck, names, [(C, H), (Hv * Dv, H), (Hv, H), (Hv, H)], dtype)


def _packed_in_proj(ck: Checkpoint, cfg: ModelConfig, q: str, dtype) -> np.ndarray:
    """Qwen3-Next: in_proj_qkvz rows per key head g = [q_g (Dk) | k_g (Dk) | v (r*Dv) | z (r*Dv)] and
    in_proj_ba rows per g = [b (r) | a (r)], r = Hv / Hk value heads per key head; value head
    g*r + j is the j-th of group g."""
    H, Hk, Hv, Dk, Dv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, \
        cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = Hv // Hk
    qkvz = read_tensor(ck, f"{q}in_proj_qkvz.weight", (Hk * (2 * Dk + 2 * r * Dv), H), dtype)
    ba = read_tensor(ck, f"{q}in_proj_ba.weight", (Hk * 2 * r, H), dtype)
    qkvz, ba = (w.reshape(Hk, -1, *w.shape[1:]) for w in (qkvz, ba))     # a row: H values, or FP8 blocks
    parts = [qkvz[:, :Dk], qkvz[:, Dk:2 * Dk], qkvz[:, 2 * Dk:2 * Dk + r * Dv], qkvz[:, 2 * Dk + r * Dv:],
             ba[:, :r], ba[:, r:]]
    rows = [np.ascontiguousarray(np.concatenate([x.reshape(-1, *x.shape[2:]) for x in group]))
            for group in (parts[:4], parts[4:])]
    if rows[0].shape[1:] == rows[1].shape[1:] and rows[0].dtype == rows[1].dtype:
        return np.concatenate(rows)
    return tuple(rows)                    # FP8 qkvz with a dense ba: two parts along the rows


def _mlp(ck: Checkpoint, cfg: ModelConfig, i: int, p: str, dtype) -> dict:
    H = cfg.hidden_size
    if not cfg.is_moe_layer(i):
        gate_up, down = dense_banks(ck, cfg, p, dtype)
        return dict(gate_up=gate_up, down=down)
    out = dict(router=read_tensor(ck, f"{p}mlp.gate.weight", (cfg.num_experts, H), dtype))
    out["gate_up"], out["down"] = expert_banks(ck, cfg, p, dtype)
    Is = cfg.shared_expert_intermediate_size
    if Is:
        gate_up, down = _shared_expert(ck, f"{p}mlp.shared_expert.", H, Is, dtype)
        out.update(shared_gate_up=gate_up, shared_down=down,
                   shared_gate=read_tensor(ck, f"{p}mlp.shared_expert_gate.weight", (1, H), dtype))
    return out


def _shared_expert(ck: Checkpoint, s: str, H: int, Is: int, dtype) -> tuple:
    """One-expert banks gate_up [1, 2Is, H], down [1, H, Is]: FP8 row blocks when all three
    projections keep blocks, else dense (an FP8 one widened), so the two banks share a kind."""
    names, shapes = [f"{s}{n}_proj.weight" for n in ("gate", "up", "down")], [(Is, H), (Is, H), (H, Is)]
    if all(is_fp8(ck, n) and keeps_blocks(sh) for n, sh in zip(names, shapes)):
        return fp8_stacked(ck, names[:2], shapes[:2])[None], fp8_stacked(ck, names[2:], shapes[2:])[None]
    return read_stacked(ck, names[:2], shapes[:2], dtype)[None], read_stacked(ck, names[2:], shapes[2:], dtype)[None]
