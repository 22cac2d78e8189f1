"""The tensors of a GGUF file that FreeToken keeps in the file's blocks (kernels/qblocks.py): the
routed experts as banks, and the dense linears (attention, output) and the embedding table. Each is
read from the file straight into its array (`os.preadv`), not through the memory map, whose touched
pages would count in the process's RSS as a second copy.

Shape legend: E experts, I expert width, H hidden, M rows, V values per block, B block bytes.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.gguf_file import GGUFModel


def block_format(t):
    """The qblocks format of tensor t, or None for F32/F16/BF16."""
    from freetoken.kernels.qformats import FORMATS
    return next((f for f in FORMATS if f.name == t.type_name.lower()), None)


def read_blocks(t) -> np.ndarray:
    """A quantized tensor's blocks: t.shape with its last axis (values) as [values/V, B]."""
    from freetoken.models.safetensors_io import read_spans
    out = np.empty(t.shape[:-1] + _blocks(t), np.uint8)
    read_spans(t.file, [(t.offset, out)])
    return out


def stacked_blocks(tensors: list):
    """Tensors stacked along their rows in one array of blocks when they share one format, else
    None (the caller keeps them as parts)."""
    from freetoken.models.safetensors_io import read_spans
    fmts = {block_format(t) for t in tensors}
    if len(fmts) != 1 or None in fmts:
        return None
    rows = [t.shape[0] for t in tensors]
    out = np.empty((sum(rows),) + _blocks(tensors[0]), np.uint8)
    starts = np.cumsum([0] + rows)
    for t, lo, hi in zip(tensors, starts[:-1], starts[1:]):
        read_spans(t.file, [(t.offset, out[lo:hi])])
    return out


def gate_up_names(model: GGUFModel, p: str) -> list[str]:
    """The tensors of a layer's gate and up experts: one ffn_gate_up_exps [E, 2I, H] (the
    converter's --fuse-gate-up-exps: each expert's gate rows, then its up rows, FreeToken's bank
    layout) or ffn_gate_exps and ffn_up_exps [E, I, H]."""
    fused = f"{p}ffn_gate_up_exps.weight"
    return [fused] if fused in model.tensors else [f"{p}ffn_gate_exps.weight", f"{p}ffn_up_exps.weight"]


def gate_up_layout(model: GGUFModel, p: str, E: int, I: int, H: int) -> dict:
    """{name: shape} of gate_up_names."""
    names = gate_up_names(model, p)
    return {n: (E, 2 * I // len(names), H) for n in names}


def expert_names(model: GGUFModel, i: int) -> list[str]:
    """Every expert tensor of MoE layer i."""
    return gate_up_names(model, f"blk.{i}.") + [f"blk.{i}.ffn_down_exps.weight"]


def quantized_banks(model: GGUFModel, p: str, E: int, I: int) -> tuple[np.ndarray, np.ndarray]:
    """A layer's experts in the file's blocks (kernels/qblocks.py), read from the file straight
    into their arrays (no pass through the memory map, so no page-cache copy counts as ours):
    gate_up uint8[E, 2I, H/V, B] (each expert's gate rows, then its up rows), down [E, H, I/V, B]."""
    from freetoken.models.safetensors_io import read_spans
    parts, down = [model.tensors[n] for n in gate_up_names(model, p)], model.tensors[f"{p}ffn_down_exps.weight"]
    gate_up, dn = np.empty((E, 2 * I) + _blocks(parts[0]), np.uint8), np.empty(down.shape[:2] + _blocks(down), np.uint8)
    read_spans(down.file, [(down.offset, dn)])
    if len(parts) == 1:                          # fused: the bank as stored
        read_spans(parts[0].file, [(parts[0].offset, gate_up)])
        return gate_up, dn
    per_expert = gate_up[0, :I].nbytes
    for t, rows in zip(parts, (slice(0, I), slice(I, 2 * I))):
        read_spans(t.file, [(t.offset + e * per_expert, gate_up[e, rows]) for e in range(E)])
    return gate_up, dn


def _blocks(t) -> tuple[int, int]:
    """(blocks per row, bytes per block) of a quantized tensor."""
    nbytes = block_format(t).nbytes
    return t.data.shape[-1] // nbytes, nbytes


def experts_stay_quantized(model: GGUFModel, cfg: ModelConfig) -> str:
    """Why the routed experts are widened at load, or "" when they stay in the file's blocks:
    every expert tensor is of a block format the kernels read (kernels/qblocks.py) and each
    layer's gate and up share one (they are stacked into one bank)."""
    for i in cfg.moe_layers:
        tensors = [model.tensors[n] for n in expert_names(model, i)]
        types = "/".join(t.type_name for t in tensors)
        if None in {block_format(t) for t in tensors}:
            return f"layer {i}'s experts are {types}, not all block formats"
        if len({t.type_name for t in tensors[:-1]}) > 1:
            return f"layer {i}'s gate and up experts are {types} (gate, up, down): not one format"
    return ""
