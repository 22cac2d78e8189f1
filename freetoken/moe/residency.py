"""One expert cache for all MoE layers: the residency step (docs/design.md, The residency step),
as a numpy spec.

The CUDA residency kernel must match this bit for bit (slots, owners, usage, recency, rewritten
ids, fill plan) over long random sequences, so everything is integer and every tie has a stated
order. Clarity over speed: this is the definition, written as a plain loop.

Any S >= 1 works: a step fetches at most as many misses as it has evictable slots (slots not
holding an expert this layer-step routes), and the misses left over run on the CPU. So the cache
size changes only how fast a step is, never whether it runs (docs/moe.md, "Any cache size").

Shape legend: T tokens, k routed, L layers (MoE layers only), E experts, S slots, q fills.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.moe.split import FetchPolicy

COUNTERS = ("hits", "misses", "fills", "cpu_execs", "evictions")
_TAKEN = np.iinfo(np.int64).max          # victim key of a slot this step must not evict


@dataclass(frozen=True)
class Fills:
    """The copy plan of one step: expert `experts[i]` of the layer goes to slot `slots[i]` (int32[q])."""

    slots: np.ndarray
    experts: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)


class SlotCache:
    """Residency table of S slots shared by L layers of E experts; flat id = layer * E + expert.

    Counters are per layer, in units of distinct experts of a layer-step: hits + misses = routed,
    fills + cpu_execs = misses; evictions are charged to the layer whose step evicted.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        if min(num_layers, num_experts, num_slots) < 1:
            raise ValueError(f"SlotCache needs L, E, S >= 1, got {num_layers}, {num_experts}, {num_slots}")
        self.L, self.E, self.S = num_layers, num_experts, num_slots
        self.slot_for = np.empty((self.L, self.E), np.int32)     # [L,E] slot or -1
        self.owner_of = np.empty(self.S, np.int32)               # [S] flat id or -1
        self.usage = np.empty(self.S, np.int64)                  # [S] clock of last touch
        self.recency = np.empty((self.L, self.E), np.int64)      # [L,E] clock last routed, -1 never
        self.counters = {name: np.zeros(self.L, np.int64) for name in COUNTERS}
        self.reset()

    def reset(self) -> None:
        """Cold cache: nothing resident, clock 0, recency forgotten, counters zeroed."""
        self.slot_for.fill(-1)
        self.owner_of.fill(-1)
        self.usage.fill(0)
        self.recency.fill(-1)
        self.clock = 0
        for c in self.counters.values():
            c.fill(0)

    def step(self, layer: int, ids: np.ndarray, policy: FetchPolicy) -> Fills:
        """Residency step for one MoE layer call; rewrites ids int32[T,k] in place to slot or -1.

        The preconditions are checked before part 1, so a step that raises changes nothing.
        q is the policy's count, bounded by the evictable slots: every hit pins its slot, so S - hits
        slots can take a fill (for fetch-all that bound bites only when S < distinct routed).
        """
        routed = self._dedup(layer, ids)
        self.clock += 1                                           # part 1
        resident = self.slot_for[layer, routed]                   # slot per routed expert, or -1
        self.usage[resident[resident >= 0]] = self.clock          # part 2: hits
        recency = self.recency[layer]
        misses = sorted((e for e, s in zip(routed, resident.tolist()) if s < 0),
                        key=lambda e: policy.miss_key(int(recency[e]), e))   # part 3
        hits = len(routed) - len(misses)
        q = min(policy.count(len(misses)), self.S - hits)         # part 4: evictable slots
        fills = self._fill(layer, routed, misses[:q])             # part 5
        recency[routed] = self.clock                              # part 6
        self._rewrite(layer, ids)                                 # part 7
        self._count(layer, hits, len(misses), q)                  # part 8
        return fills

    def _dedup(self, layer: int, ids: np.ndarray) -> list[int]:
        """Distinct routed experts in first-seen (row-major) order; checks the preconditions."""
        if not 0 <= layer < self.L:
            raise IndexError(f"MoE layer {layer} outside [0, {self.L})")
        if ids.dtype != np.int32 or ids.ndim != 2:
            raise TypeError(f"routed ids must be int32[T,k], got {ids.dtype}{list(ids.shape)}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.E):
            raise ValueError(f"routed ids must lie in [0, {self.E}), got [{ids.min()}, {ids.max()}]")
        return list(dict.fromkeys(ids.ravel().tolist()))

    def _fill(self, layer: int, routed: list[int], fetch: list[int]) -> Fills:
        """Give each fetched expert the LRU slot among slots no routed expert of this layer owns."""
        # Victim key = usage, with the slots of this step's routed experts (hits, earlier fills)
        # taken out; argmin returns the first of equal keys, so ties go to the lower slot.
        key = self.usage.copy()
        owned = self.slot_for[layer, routed]
        key[owned[owned >= 0]] = _TAKEN
        slots = np.empty(len(fetch), np.int32)
        for i, e in enumerate(fetch):
            victim = int(key.argmin())
            old = int(self.owner_of[victim])
            if old >= 0:
                self.slot_for[old // self.E, old % self.E] = -1
                self.counters["evictions"][layer] += 1
            self.owner_of[victim] = layer * self.E + e
            self.slot_for[layer, e] = victim
            self.usage[victim] = self.clock
            key[victim] = _TAKEN
            slots[i] = victim
        return Fills(slots, np.asarray(fetch, np.int32))

    def _rewrite(self, layer: int, ids: np.ndarray) -> None:
        """ids[t, j] := slot of (layer, ids[t, j]) if resident, else -1 (run on the CPU)."""
        ids[...] = self.slot_for[layer][ids]

    def _count(self, layer: int, hits: int, misses: int, fills: int) -> None:
        c = self.counters
        c["hits"][layer] += hits
        c["misses"][layer] += misses
        c["fills"][layer] += fills
        c["cpu_execs"][layer] += misses - fills
