"""Recurrent-state pool of a Gated DeltaNet hybrid: one row per running request, every GDN layer.

A row holds, per GDN layer, the conv state (the last K-1 conv inputs) and the delta-rule state,
both float32; the request owns its row from admission to finish. Rows are zeroed when handed out
(a new sequence starts from zero state). Sized once at start-up: --max-running-requests rows.
Shape legend: Lg GDN layers, N rows, K conv kernel, C conv channels, Hv value heads, Dk/Dv dims.
"""
from __future__ import annotations

import numpy as np


class StatePool:
    def __init__(self, num_layers: int, rows: int, conv_dim: int, kernel: int, value_heads: int,
                 key_dim: int, value_dim: int, xp=np):
        self.rows = rows
        self.conv = xp.zeros((num_layers, rows, kernel - 1, conv_dim), np.float32)           # [Lg, N, K-1, C]
        self.rule = xp.zeros((num_layers, rows, value_heads, key_dim, value_dim), np.float32)  # [Lg, N, Hv, Dk, Dv]
        self._free = list(range(rows - 1, -1, -1))

    @classmethod
    def for_model(cls, cfg, rows: int, xp=np) -> "StatePool":
        return cls(len(cfg.linear_layers), rows, cfg.conv_dim, cfg.linear_conv_kernel_dim,
                   cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, xp)

    @staticmethod
    def bytes_per_row(cfg, chunk: int = 0, kv_itemsize: int = 4) -> int:
        """One row, fp32 whatever the KV's dtype and the prefill chunk (WindowPool's signature)."""
        per_layer = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim + \
            cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        return 4 * per_layer * len(cfg.linear_layers)

    @staticmethod
    def checkpoint_bytes(cfg, kv_itemsize: int = 4) -> int:
        """A checkpoint is one whole row."""
        return StatePool.bytes_per_row(cfg)

    def layer(self, j: int):
        """(conv states [N, K-1, C], rule states [N, Hv, Dk, Dv]) of GDN layer j, written in place."""
        return self.conv[j], self.rule[j]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> int:
        return int(self.conv.nbytes + self.rule.nbytes)

    def checkpoint_parts(self) -> dict:
        """What a state checkpoint holds (engine/checkpoints.py): name -> (shape, dtype) of one row."""
        return {"conv": (self.conv.shape[:1] + self.conv.shape[2:], np.float32),
                "rule": (self.rule.shape[:1] + self.rule.shape[2:], np.float32)}

    def read(self, row: int, position: int) -> dict:
        """Row `row`'s state, every GDN layer (the position is the row's own: it has one state)."""
        return {"conv": self.conv[:, row], "rule": self.rule[:, row]}

    def capture(self, kind: str, j: int, state, position: int):
        """What a checkpoint keeps of GDN layer j's state row handed to its sink: all of it."""
        return state

    def write(self, row: int, position: int, parts: dict) -> None:
        """Row `row` resumes from a checkpoint's parts (device arrays)."""
        self.conv[:, row] = parts["conv"]
        self.rule[:, row] = parts["rule"]

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.rows} recurrent-state rows are in use")
        row = self._free.pop()
        self.conv[:, row] = 0
        self.rule[:, row] = 0
        return row

    def free(self, row: int) -> None:
        assert row not in self._free, "state row freed twice"
        self._free.append(row)
