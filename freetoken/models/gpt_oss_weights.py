"""gpt-oss (GptOssForCausalLM) weights: its layer dataclass and the Hugging Face loader, for the
checkpoint as the hub ships it (experts in MXFP4 blocks, the rest bf16) and for the dense layout
(bf16 or fp32, as transformers' save_pretrained writes it).

What differs from Qwen3-MoE, and how it is read:
- dense experts are stored transposed, [E, H, 2I] and [E, I, H], with gate and up columns
  interleaved (gate at even columns, up at odd ones): read into FreeToken's [E, 2I, H] (gate rows
  first) and [E, H, I], one expert at a time;
- MXFP4 experts are stored as rows of blocks, [E, 2I, H/32] (gate and up rows interleaved) and
  [E, H, I/32]: kept in their blocks, re-packed into the mxfp4 block format at load;
- biases on q/k/v/o, the router and both expert projections, and one sink logit per query head:
  kept in fp32 whatever the checkpoint's dtype (they are added to fp32 activations);
- no q/k norms, no dense-MLP layers.

Shape legend: H hidden, E experts, I expert width, Hq query heads, G kv heads, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.config import ModelConfig
from freetoken.kernels.qmxfp4 import from_hub_blocks
from freetoken.models.weights import ModelWeights, model_weights, read_stacked, read_tensor


@dataclass(frozen=True, eq=False)
class GptOssLayerWeights:
    """One decoder layer. Matrices and norms in the model dtype (uint16 bf16 or float32); biases and
    sinks float32."""

    input_norm: np.ndarray    # [H]
    post_norm: np.ndarray     # [H]
    qkv: np.ndarray           # [(Hq+2G)*D, H]  q rows, then k rows, then v rows
    qkv_bias: np.ndarray      # f32[(Hq+2G)*D]
    o_proj: np.ndarray        # [H, Hq*D]
    o_bias: np.ndarray        # f32[H]
    sinks: np.ndarray         # f32[Hq]
    router: np.ndarray        # [E, H]
    router_bias: np.ndarray   # f32[E]
    gate_up: np.ndarray       # [E, 2I, H] gate rows first
    down: np.ndarray          # [E, H, I]
    gate_up_bias: np.ndarray  # f32[E, 2I] gate first
    down_bias: np.ndarray     # f32[E, H]


def load_gpt_oss(ck, cfg: ModelConfig, dtype: np.dtype, log=None) -> ModelWeights:
    """A gpt-oss checkpoint into ModelWeights of GptOssLayerWeights."""
    return model_weights(ck, cfg, dtype, _load_layer)


def _load_layer(ck, cfg: ModelConfig, i: int, dtype: np.dtype) -> GptOssLayerWeights:
    p = f"model.layers.{i}."
    H, D, Hq, G, E = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts
    rows = [Hq * D, G * D, G * D]
    attn = f"{p}self_attn."
    gate_up, down, gate_up_bias, down_bias = _experts(ck, cfg, f"{p}mlp.experts.", dtype)
    return GptOssLayerWeights(
        input_norm=read_tensor(ck, f"{p}input_layernorm.weight", (H,), dtype),
        post_norm=read_tensor(ck, f"{p}post_attention_layernorm.weight", (H,), dtype),
        qkv=read_stacked(ck, [f"{attn}{x}_proj.weight" for x in "qkv"], [(r, H) for r in rows], dtype),
        qkv_bias=np.concatenate([_f32(ck, f"{attn}{x}_proj.bias", (r,)) for x, r in zip("qkv", rows)]),
        o_proj=read_tensor(ck, f"{attn}o_proj.weight", (H, Hq * D), dtype),
        o_bias=_f32(ck, f"{attn}o_proj.bias", (H,)),
        sinks=_f32(ck, f"{attn}sinks", (Hq,)),
        router=read_tensor(ck, f"{p}mlp.router.weight", (E, H), dtype),
        router_bias=_f32(ck, f"{p}mlp.router.bias", (E,)),
        gate_up=gate_up, down=down, gate_up_bias=gate_up_bias, down_bias=down_bias)


def _f32(ck, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return read_tensor(ck, name, shape, np.dtype(np.float32))


def _experts(ck, cfg: ModelConfig, p: str, dtype: np.dtype) -> tuple:
    """gate_up [E, 2I, H] (gate rows first), down [E, H, I] and their biases from the stored
    [E, H, 2I] (gate and up columns interleaved) and [E, I, H]."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    bias = _f32(ck, f"{p}gate_up_proj_bias", (E, 2 * I))
    gate_up_bias = np.concatenate([bias[:, 0::2], bias[:, 1::2]], axis=1)
    down_bias = _f32(ck, f"{p}down_proj_bias", (E, H))
    if f"{p}gate_up_proj_blocks" in ck:                  # as the hub ships it
        gate_first = np.concatenate([np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)])
        return (_mxfp4_bank(ck, f"{p}gate_up_proj", (E, 2 * I, H), gate_first),
                _mxfp4_bank(ck, f"{p}down_proj", (E, H, I)), gate_up_bias, down_bias)
    stored_gu = read_tensor(ck, f"{p}gate_up_proj", (E, H, 2 * I), dtype)
    stored_down = read_tensor(ck, f"{p}down_proj", (E, I, H), dtype)
    gate_up = np.empty((E, 2 * I, H), dtype)
    down = np.empty((E, H, I), dtype)
    for e in range(E):
        gate_up[e, :I] = stored_gu[e, :, 0::2].T
        gate_up[e, I:] = stored_gu[e, :, 1::2].T
        down[e] = stored_down[e].T
    return gate_up, down, gate_up_bias, down_bias


def _mxfp4_bank(ck, name: str, shape: tuple[int, int, int], row_order=None) -> np.ndarray:
    """u8[E, R, C/32, 17]: the MXFP4 blocks `name`_blocks u8[E, R, C/32, 16] (value 2i in the low
    nibble of byte i, 2i+1 in its high one) and exponents `name`_scales u8[E, R, C/32] as the mxfp4
    block format (kernels/qmxfp4.py: the exponent first, value j and j+16 in byte 1+j); the same
    exponent, the same codes, so the values are the stored ones exactly. row_order: the rows' new order."""
    E, R, C = shape
    blocks = ck.get(f"{name}_blocks", (E, R, C // 32, 16))
    scales = ck.get(f"{name}_scales", (E, R, C // 32))
    out = np.empty((E, R, C // 32, 17), np.uint8)
    for e in range(E):
        from_hub_blocks(blocks[e], scales[e], row_order, out[e])
    return out
