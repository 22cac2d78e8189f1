"""Token-granular KV pool: one preallocated array per layer, slots handed out from a free list.

Shape legend: L layers, N token slots, G kv heads, D head dim.
"""
from __future__ import annotations

import numpy as np


class KVPoolFull(RuntimeError):
    """No free KV slots left."""


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype, xp=np):
        self.num_slots = num_slots
        shape = (num_layers, num_slots, kv_heads, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)            # [L, N, G, D]
        self.v = xp.zeros(shape, dtype=dtype)
        # LIFO free list: recently freed slots are reused first (warm in cache).
        self._free = list(range(num_slots - 1, -1, -1))

    def layer(self, layer: int):
        return self.k[layer], self.v[layer]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolFull(f"need {n} KV slots, {len(self._free)} free of {self.num_slots}")
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, slots) -> None:
        self._free.extend(int(s) for s in reversed(slots))
        assert len(self._free) <= self.num_slots, "KV slot freed twice"
