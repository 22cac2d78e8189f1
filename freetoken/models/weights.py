"""ModelWeights / LayerWeights, the Qwen3-MoE loader, and the reading helpers every family's
loader shares (models/hf_gdn.py uses them too). The safetensors reader and writer live in
models/safetensors_io.py (re-exported here).

Layout of ModelWeights/LayerWeights: docs/contracts.md. bf16 travels as uint16.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freetoken.config import ModelConfig
from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.models.fp8_weights import fp8_expert_banks, fp8_stacked, is_fp8, read_fp8
from freetoken.progress import progress
from freetoken.models.safetensors_io import (Checkpoint, SafetensorsFile, WeightsError,  # noqa: F401
                                             save_safetensors)


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer. Dtype uint16 (bf16) or float32, the same for every array of a model."""

    input_norm: np.ndarray    # [H]
    post_norm: np.ndarray     # [H]
    qkv: np.ndarray | tuple   # [(Hq+2G)*D, H]  q rows, then k rows, then v rows (GGUF of mixed formats: the parts)
    o_proj: np.ndarray        # [H, Hq*D]
    q_norm: np.ndarray        # [D]
    k_norm: np.ndarray        # [D]
    router: np.ndarray | None  # [E, H]; None for dense-MLP layers
    gate_up: np.ndarray       # [E, 2I, H] gate rows first; dense-MLP layers [1, 2*I_dense, H]
    down: np.ndarray          # [E, H, I]; dense-MLP layers [1, H, I_dense]


@dataclass(frozen=True, eq=False)
class ModelWeights:
    embed: np.ndarray         # [V, H]
    final_norm: np.ndarray    # [H]
    lm_head: np.ndarray       # [V, H]; the embed array itself when tie_word_embeddings
    layers: tuple[LayerWeights, ...]


# --- loading: any family through the architecture table; the Qwen3-MoE loader ------------------

def load_weights(model_dir: str | Path, cfg: ModelConfig, log=None) -> ModelWeights:
    """Load a checkpoint of any registered family into ModelWeights: uint16 when the checkpoint is
    (mostly) bf16, float32 otherwise; each tensor whose stored dtype matches is read from the file
    straight into its place in the final arrays (no mapping, no second copy). The family's loader
    comes from the architecture table (models/registry.py)."""
    from freetoken.models.registry import weights_loader
    ck = Checkpoint(model_dir)
    dtype = np.dtype(np.uint16) if ck.bf16_majority() else np.dtype(np.float32)
    return weights_loader(cfg.architecture)(ck, cfg, dtype, log)


def load_qwen3_moe(ck: Checkpoint, cfg: ModelConfig, dtype: np.dtype, log=None) -> ModelWeights:
    """A Qwen3-MoE checkpoint (Qwen3MoeForCausalLM) into ModelWeights."""
    return model_weights(ck, cfg, dtype, _load_layer)


def model_weights(ck: Checkpoint, cfg: ModelConfig, dtype: np.dtype, load_layer) -> ModelWeights:
    """The embedding, final norm and output head of a HF checkpoint, and its layers read by
    load_layer(ck, cfg, i, dtype) side by side (load_layers)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = read_tensor(ck, "model.embed_tokens.weight", (V, H), dtype)
    lm_head = embed if cfg.tie_word_embeddings else read_tensor(ck, "lm_head.weight", (V, H), dtype)
    layers = load_layers(lambda i: load_layer(ck, cfg, i, dtype), cfg.num_layers)
    return ModelWeights(embed=embed, final_norm=read_tensor(ck, "model.norm.weight", (H,), dtype),
                        lm_head=lm_head, layers=layers)


def load_layers(load_one, n: int) -> tuple:
    """(load_one(0), ..., load_one(n - 1)) with one thread per core reading layers side by side:
    a read is a copy out of the page cache (or a disk read) that releases the GIL, so two threads
    loaded medium's 2.5 GB in 0.54 s instead of 1.22 (2-core Xeon, warm page cache)."""
    threads = max(1, min(n, len(os.sched_getaffinity(0)), 8))
    with ThreadPoolExecutor(threads, thread_name_prefix="freetoken-load") as pool:
        return tuple(progress(pool.map(load_one, range(n)), n, "loading layers"))


def read_tensor(ck: Checkpoint, name: str, shape: tuple[int, ...], dtype: np.dtype,
          out: np.ndarray | None = None) -> np.ndarray:
    """Tensor `name` in the model dtype, into `out` when given: read straight into it when the
    stored dtype matches, else read, converted and copied."""
    if is_fp8(ck, name) or (name in ck and ck.stored_dtype(name) == "F8_E4M3"):
        return read_fp8(ck, name, shape, dtype, out)             # one without its scales: an error there
    arr = ck.get(name, shape, out)
    if arr is out:
        return out
    if arr.dtype != dtype:
        arr = from_f32(arr) if dtype == np.uint16 else to_f32(arr)
    if out is None:
        return arr
    out[...] = arr.reshape(out.shape)
    return out


def _load_layer(ck: Checkpoint, cfg: ModelConfig, i: int, dtype: np.dtype) -> LayerWeights:
    p = f"model.layers.{i}."
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    names = [f"{p}self_attn.{proj}_proj.weight" for proj in "qkv"]
    shapes = [(Hq * D, H), (G * D, H), (G * D, H)]
    qkv = fp8_stacked(ck, names, shapes)          # FP8 row blocks, or None: [(Hq+2G)*D, H]
    if qkv is None:
        qkv = read_stacked(ck, names, shapes, dtype)
    if cfg.is_moe_layer(i):
        router = read_tensor(ck, f"{p}mlp.gate.weight", (cfg.num_experts, H), dtype)
        gate_up, down = expert_banks(ck, cfg, p, dtype)
    else:
        router = None
        gate_up, down = dense_banks(ck, cfg, p, dtype)
    return LayerWeights(
        input_norm=read_tensor(ck, f"{p}input_layernorm.weight", (H,), dtype),
        post_norm=read_tensor(ck, f"{p}post_attention_layernorm.weight", (H,), dtype),
        qkv=qkv,
        o_proj=read_tensor(ck, f"{p}self_attn.o_proj.weight", (H, Hq * D), dtype),
        q_norm=read_tensor(ck, f"{p}self_attn.q_norm.weight", (D,), dtype),
        k_norm=read_tensor(ck, f"{p}self_attn.k_norm.weight", (D,), dtype),
        router=router, gate_up=gate_up, down=down)


def read_stacked(ck: Checkpoint, names: list[str], shapes: list[tuple[int, int]], dtype: np.dtype) -> np.ndarray:
    """Linears stacked along their rows in one dense array of the model dtype, each read into its
    rows (an FP8 one widened by the spec)."""
    out = np.empty((sum(s[0] for s in shapes), shapes[0][1]), dtype)
    for rows, name, shape in zip(row_slices(*(s[0] for s in shapes)), names, shapes):
        read_tensor(ck, name, shape, dtype, out=out[rows])
    return out


def row_slices(*sizes: int) -> list[slice]:
    starts = np.cumsum((0,) + sizes)
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def expert_banks(ck: Checkpoint, cfg: ModelConfig, p: str,
                  dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """gate_up [E, 2I, H] (gate rows first) and down [E, H, I], each expert contiguous."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    banks = fp8_expert_banks(ck, E, I, H, p)
    if banks is not None:
        return banks
    if f"{p}mlp.experts.gate_up_proj" in ck:  # transformers-5 packed layout is already ours
        return (read_tensor(ck, f"{p}mlp.experts.gate_up_proj", (E, 2 * I, H), dtype),
                read_tensor(ck, f"{p}mlp.experts.down_proj", (E, H, I), dtype))
    gate_up = np.empty((E, 2 * I, H), dtype)
    down = np.empty((E, H, I), dtype)
    items = []          # read into a preallocated bank: no list of copies, no np.stack
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        items += [(f"{q}gate_proj.weight", (I, H), gate_up[e, :I]),
                  (f"{q}up_proj.weight", (I, H), gate_up[e, I:]),
                  (f"{q}down_proj.weight", (H, I), down[e])]
    for name, shape, out in ck.read_many([item for item in items if not is_fp8(ck, item[0])]) + \
            [item for item in items if is_fp8(ck, item[0])]:
        read_tensor(ck, name, shape, dtype, out=out)
    return gate_up, down


def dense_banks(ck: Checkpoint, cfg: ModelConfig, p: str,
                 dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A dense-MLP layer as a one-expert bank: gate_up [1, 2I, H], down [1, H, I]."""
    I, H = cfg.intermediate_size, cfg.hidden_size
    gate_up = read_stacked(ck, [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"], [(I, H), (I, H)], dtype)
    down = read_stacked(ck, [f"{p}mlp.down_proj.weight"], [(H, I)], dtype)   # dense like gate_up: FP8 widened
    return gate_up[None], down[None]
