"""Recurrent-state checkpoints of a hybrid model, each linked to the radix-tree node whose end is
the token position it was taken at, so a later request can resume from the deepest cached prefix
that has both its KV and its state.

Host memory holds them (the CPU path's only tier; on a GPU this is the second tier of the design,
and no device tier exists yet). The pool has its own byte budget and evicts least recently used
first; evicting one unlinks its node, and a node the tree evicts drops its checkpoint (the tree
calls ``drop``), so no node ever points at freed memory and no checkpoint outlives its KV.
Shape legend: Lg GDN layers, K conv kernel, C conv channels, Hv value heads, Dk / Dv.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class Checkpoint:
    position: int                # tokens consumed when it was taken
    conv: np.ndarray             # f32[Lg, K-1, C]
    rule: np.ndarray             # f32[Lg, Hv, Dk, Dv]
    node: object = None          # the radix node it is linked to (None while pending)

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.rule.nbytes)


@dataclass
class Counters:
    taken: int = 0
    hits: int = 0
    evicted: int = 0
    dropped: int = 0             # unlinked because their KV prefix was evicted or never cached
    reused_tokens: int = 0       # prompt tokens requests did not recompute thanks to a checkpoint


class CheckpointPool:
    def __init__(self, budget_bytes: int, to_host, to_device):
        self.budget = int(budget_bytes)
        self._to_host, self._to_device = to_host, to_device
        self._lru: OrderedDict[int, Checkpoint] = OrderedDict()   # linked checkpoints, oldest first
        self.bytes = 0
        self.counters = Counters()

    def take(self, states, row: int, position: int) -> Checkpoint | None:
        """A host copy of state row `row` after `position` tokens (None when the budget cannot
        hold even one)."""
        one = states.conv[:, row].nbytes + states.rule[:, row].nbytes
        if one > self.budget:
            return None
        self.counters.taken += 1
        return Checkpoint(position, np.array(self._to_host(states.conv[:, row])),
                          np.array(self._to_host(states.rule[:, row])))

    def link(self, ckpt: Checkpoint, node) -> None:
        """Make `ckpt` the node's checkpoint (replacing an older one), then evict to the budget."""
        if node.checkpoint is not None:
            self.drop(node.checkpoint)
        ckpt.node, node.checkpoint = node, ckpt
        self._lru[id(ckpt)] = ckpt
        self.bytes += ckpt.nbytes
        while self.bytes > self.budget and self._lru:
            self._unlink(next(iter(self._lru.values())))
            self.counters.evicted += 1

    def restore(self, ckpt: Checkpoint, states, row: int) -> None:
        states.conv[:, row] = self._to_device(ckpt.conv)
        states.rule[:, row] = self._to_device(ckpt.rule)
        self._lru.move_to_end(id(ckpt))
        self.counters.hits += 1
        self.counters.reused_tokens += ckpt.position

    def drop(self, ckpt: Checkpoint) -> None:
        """Unlink and free one checkpoint (its node is going away, or a newer one replaces it)."""
        if id(ckpt) in self._lru:
            self._unlink(ckpt)
            self.counters.dropped += 1

    def _unlink(self, ckpt: Checkpoint) -> None:
        del self._lru[id(ckpt)]
        self.bytes -= ckpt.nbytes
        if ckpt.node is not None and ckpt.node.checkpoint is ckpt:
            ckpt.node.checkpoint = None
        ckpt.node = None

    def clear(self) -> None:
        """Unlink and free every checkpoint (the tree they hang from is being replaced)."""
        for ckpt in list(self._lru.values()):
            self._unlink(ckpt)
            self.counters.dropped += 1

    def __len__(self) -> int:
        return len(self._lru)

    def status(self) -> dict:
        c = self.counters
        return {"checkpoints": len(self), "bytes": self.bytes, "budget_bytes": self.budget, "tier": "host",
                "taken": c.taken, "hits": c.hits, "evicted": c.evicted, "dropped": c.dropped,
                "reused_tokens": c.reused_tokens}
