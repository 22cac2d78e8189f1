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


def quantized_banks(model: GGUFModel, p: str, E: int, I: int) -> tuple[np.ndarray, np.ndarray]:
    """A layer's experts in the file's blocks (kernels/qblocks.py), read from the file straight
    into their arrays (no pass through the memory map, so no page-cache copy counts as ours):
    gate_up uint8[E, 2I, H/V, B] (each expert's gate rows, then its up rows), down [E, H, I/V, B]."""
    from freetoken.models.safetensors_io import read_spans
    gate, up, down = (model.tensors[f"{p}ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    gate_up, dn = np.empty((E, 2 * I) + _blocks(gate), np.uint8), np.empty(down.shape[:2] + _blocks(down), np.uint8)
    per_expert = gate_up[0, :I].nbytes
    read_spans(down.file, [(down.offset, dn)])
    for t, rows in ((gate, slice(0, I)), (up, slice(I, 2 * I))):
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
        gate, up, down = (model.tensors[f"blk.{i}.ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
        if None in {block_format(t) for t in (gate, up, down)}:
            return f"layer {i}'s experts are {gate.type_name}/{up.type_name}/{down.type_name}, not all block formats"
        if gate.type_name != up.type_name:
            return f"layer {i}'s gate experts are {gate.type_name} and its up experts {up.type_name}"
    return ""
