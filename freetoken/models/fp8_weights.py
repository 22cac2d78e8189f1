"""Qwen's block-FP8 checkpoints (`quantization_config.quant_method: "fp8"`, `weight_block_size`
[128, 128]): a linear stored as float8_e4m3fn codes `X.weight` [M, K] with `X.weight_scale_inv`
[ceil(M/128), ceil(K/128)] (bf16, fp16 or float32 by release). Modules the release left out of the
conversion (`modules_to_not_convert`: router, embeddings, norms, head) have no scale tensor and
load as before, so the list needs no reading of its own.

A weight whose K is a multiple of 128 is kept in FreeToken's FP8 row blocks (kernels/qfp8.py), read
by the same ops as GGUF blocks; one whose K is not, or one read into a dense array (a stacked q/k/v
whose parts are not all FP8), is widened by the spec: the code's value times its tile's scale in
fp32, then the model dtype.

Shape legend: M rows, K values per row, E experts, I expert width, H hidden.
"""
from __future__ import annotations

import numpy as np

from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.kernels.qfp8 import BLOCK, e4m3_table, to_row_blocks
from freetoken.models.safetensors_io import WeightsError


def is_fp8(ck, name: str) -> bool:
    return name + "_scale_inv" in ck


def keeps_blocks(shape: tuple[int, ...]) -> bool:
    return shape[-1] % BLOCK == 0


def read_fp8(ck, name: str, shape: tuple[int, int], dtype: np.dtype, out: np.ndarray | None = None):
    """The FP8 linear `name` of `shape` [M, K]: row blocks u8[M, K/128, 132] when K allows and no
    dense `out` is given, else widened into `out` (or a new array of the model dtype)."""
    if ck.stored_dtype(name) != "F8_E4M3":
        raise WeightsError(f"{ck.model_dir}: tensor {name!r} has a weight_scale_inv but is stored as "
                           f"{ck.stored_dtype(name)}, not F8_E4M3")
    if not is_fp8(ck, name):
        raise WeightsError(f"{ck.model_dir}: tensor {name!r} is F8_E4M3 but {name}_scale_inv is missing")
    if len(shape) != 2:        # Qwen's releases convert linears only; a packed or conv tensor is not one
        raise WeightsError(f"{ck.model_dir}: tensor {name!r} is F8_E4M3 of shape {tuple(shape)}; FreeToken reads "
                           "block FP8 for 2-D linear weights only")
    M, K = shape
    codes = ck.get(name, shape)
    scales = to_f32(ck.get(name + "_scale_inv", (-(-M // BLOCK), -(-K // BLOCK))))
    if out is None and keeps_blocks(shape):
        return to_row_blocks(codes, scales)
    full = np.repeat(np.repeat(scales, BLOCK, 0), BLOCK, 1)[:M, :K]
    values = e4m3_table()[codes] * full                              # f32: the spec's one rounding
    values = from_f32(values) if dtype == np.uint16 else values
    if out is None:
        return values
    out[...] = values
    return out


def fp8_expert_banks(ck, E: int, I: int, H: int, p: str) -> tuple[np.ndarray, np.ndarray] | None:
    """A layer's per-expert FP8 projections as row-block banks (gate_up u8[E, 2I, H/128, 132],
    down u8[E, H, I/128, 132]), or None when they are not FP8 or H or I is not a multiple of 128."""
    if not is_fp8(ck, f"{p}mlp.experts.0.gate_proj.weight") or not (keeps_blocks((H,)) and keeps_blocks((I,))):
        return None
    gate_up = np.empty((E, 2 * I, H // BLOCK, 4 + BLOCK), np.uint8)
    down = np.empty((E, H, I // BLOCK, 4 + BLOCK), np.uint8)
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        gate_up[e, :I] = read_fp8(ck, f"{q}gate_proj.weight", (I, H), np.float32)
        gate_up[e, I:] = read_fp8(ck, f"{q}up_proj.weight", (I, H), np.float32)
        down[e] = read_fp8(ck, f"{q}down_proj.weight", (H, I), np.float32)
    return gate_up, down


def fp8_stacked(ck, names: list[str], shapes: list[tuple[int, int]]) -> np.ndarray | None:
    """Linears stacked along their rows (q, k, v) in one row-block array, or None when they are
    not all FP8 with a K that keeps blocks."""
    if not all(is_fp8(ck, n) and keeps_blocks(s) for n, s in zip(names, shapes)):
        return None
    return np.concatenate([read_fp8(ck, n, s, np.float32) for n, s in zip(names, shapes)])


