"""Expert banks: one MoE layer's routed experts in host memory, the check that they all have the
model's shapes, and the slot pool's arrays for them (the host pool, host_pool.py, holds one Bank
per layer).

A bank is dense (bf16 as uint16, or f32: gate_up [E,2I,H], down [E,H,I]) or quantized as the
GGUF file stores it (uint8 [E,2I,H/V,B] and [E,H,I/V,B]: rows of blocks of V values in B bytes,
the format named by B: kernels/qblocks.py). Dense banks share one dtype. Quantized banks may
differ per layer and between gate_up and down (Q4_K_M keeps some layers' down in Q6_K): the slot
pool then holds raw bytes per slot, as many as the largest layer's expert needs, and each layer
reads it through views of its own block layout (`slot_views`).

Shape legend: E experts, H hidden, I expert width, S slots, V values per block, B block bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.kernels.qformats import is_quantized, logical_shape


@dataclass(frozen=True)
class Bank:
    """One MoE layer's experts: gate_up [E,2I,H] (gate rows first), down [E,H,I] (logical shapes)."""

    gate_up: np.ndarray
    down: np.ndarray

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def quantized(self) -> bool:
        return is_quantized(self.gate_up)

    @property
    def expert_bytes(self) -> tuple[int, int]:
        """Bytes of one expert's gate_up and down rows, as stored."""
        return self.gate_up[0].nbytes, self.down[0].nbytes


def check_banks(banks, num_experts: int, hidden: int, width: int) -> list[Bank]:
    """Banks as a list of Bank, each checked against [E,2I,H] / [E,H,I] (logical shapes) and one
    shared dtype (dense) or all quantized."""
    out, want_gu, want_dn = [], (num_experts, 2 * width, hidden), (num_experts, hidden, width)
    for j, (gate_up, down) in enumerate(banks):
        if logical_shape(gate_up) != want_gu or logical_shape(down) != want_dn:
            raise ValueError(f"MoE layer {j}: expert banks {logical_shape(gate_up)}/{logical_shape(down)}, "
                             f"expected gate_up {want_gu} and down {want_dn}")
        if gate_up.dtype != down.dtype or (out and gate_up.dtype != out[0].gate_up.dtype):
            raise ValueError(f"MoE layer {j}: expert banks mix dtypes ({gate_up.dtype}, {down.dtype})")
        if is_quantized(gate_up) != is_quantized(down) or (out and is_quantized(gate_up) != out[0].quantized):
            raise ValueError(f"MoE layer {j}: expert banks mix quantized and dense weights")
        out.append(Bank(gate_up, down))
    if not out:
        raise ValueError("no MoE layers: build_moe needs one (gate_up, down) pair per MoE layer")
    return out


def slot_pool(xp, num_slots: int, banks: list[Bank]) -> tuple:
    """The zeroed slot arrays for num_slots experts of these banks: dense, (gate_up [S,2I,H],
    down [S,H,I]); quantized, (uint8 [S, largest gate_up bytes], uint8 [S, largest down bytes])."""
    like = banks[0]
    if not like.quantized:
        return (xp.zeros((num_slots,) + like.gate_up.shape[1:], like.gate_up.dtype),
                xp.zeros((num_slots,) + like.down.shape[1:], like.down.dtype))
    gu, dn = quantized_slot_bytes(banks)
    return xp.zeros((num_slots, gu), np.uint8), xp.zeros((num_slots, dn), np.uint8)


def quantized_slot_bytes(banks: list[Bank]) -> tuple[int, int]:
    """Bytes of one slot's gate_up and down for quantized banks: the largest layer's of each (they
    may come from different layers), rounded up to 16 so every slot starts 16-byte aligned (the
    fill copies move 16-byte vectors only between aligned ends)."""
    return tuple(-(-max(b.expert_bytes[i] for b in banks) // 16) * 16 for i in (0, 1))


def slot_views(pool: tuple, bank: Bank) -> tuple:
    """The slot pool as `bank`'s layer reads it: the arrays themselves when dense; when quantized,
    per slot the first bytes of its row shaped as the layer's blocks ([S,2I,H/V,B], [S,H,I/V,B];
    contiguous but for the slot stride when the layer's experts are smaller than the largest)."""
    if not bank.quantized:
        return pool
    return tuple(raw[:, :like[0].nbytes].reshape((raw.shape[0],) + like.shape[1:])
                 for raw, like in zip(pool, (bank.gate_up, bank.down)))
