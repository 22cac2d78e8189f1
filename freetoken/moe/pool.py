"""Expert banks: one MoE layer's routed experts in host memory, and the check that they all
have the model's shapes and one dtype (the host pool, host_pool.py, holds one Bank per layer).

Shape legend: E experts, H hidden, I expert width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
