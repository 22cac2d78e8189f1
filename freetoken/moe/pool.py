"""Expert banks of the host pool and the slot pool that stands in for GPU memory on a host.

On a machine with no GPU the "device" slot pool is a host array and a fill is a memcpy
(DESIGN §5.2); this is how CI runs offload and hybrid. Slot s of gate_up and slot s of down
belong to the same expert.

Shape legend: E experts, S slots, H hidden, I expert width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.moe.residency import Fills


@dataclass(frozen=True)
class Bank:
    """One MoE layer's experts: gate_up [E,2I,H] (gate rows first), down [E,H,I]; bf16 (uint16) or f32."""

    gate_up: np.ndarray
    down: np.ndarray

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]


def check_banks(banks, num_experts: int, hidden: int, width: int) -> list[Bank]:
    """Banks as a list of Bank, each checked against [E,2I,H] / [E,H,I] and one shared dtype."""
    out, want_gu, want_dn = [], (num_experts, 2 * width, hidden), (num_experts, hidden, width)
    for j, (gate_up, down) in enumerate(banks):
        if gate_up.shape != want_gu or down.shape != want_dn:
            raise ValueError(f"MoE layer {j}: expert banks {gate_up.shape}/{down.shape}, "
                             f"expected gate_up {want_gu} and down {want_dn}")
        if gate_up.dtype != down.dtype or (out and gate_up.dtype != out[0].gate_up.dtype):
            raise ValueError(f"MoE layer {j}: expert banks mix dtypes ({gate_up.dtype}, {down.dtype})")
        out.append(Bank(gate_up, down))
    if not out:
        raise ValueError("no MoE layers: build_moe needs one (gate_up, down) pair per MoE layer")
    return out


class SlotPool:
    """S expert slots: gate_up [S,2I,H], down [S,H,I], zero-initialised so an unused slot is
    never garbage (upstream pitfall 4)."""

    def __init__(self, num_slots: int, like: Bank):
        _, two_i, hidden = like.gate_up.shape
        self.gate_up = np.zeros((num_slots, two_i, hidden), like.gate_up.dtype)
        self.down = np.zeros((num_slots, hidden, two_i // 2), like.down.dtype)

    def fill(self, bank: Bank, fills: Fills) -> None:
        """Copy expert fills.experts[i] of the layer's host bank into slot fills.slots[i]."""
        for slot, expert in zip(fills.slots.tolist(), fills.experts.tolist()):
            self.gate_up[slot] = bank.gate_up[expert]         # one expert is one contiguous copy
            self.down[slot] = bank.down[expert]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes
