"""State checkpoints of a model whose requests keep state (GDN, sliding windows), each linked to the radix-tree node whose end is
the token position it was taken at, so a later request can resume from the deepest cached prefix
that has both its KV and its state.

Two tiers, each with its own byte budget and least-recently-used order. A new checkpoint goes to
the device tier when it has room (on a GPU: memory the plan left over, engine/plan.py), so
taking and restoring one is a device copy; the device tier makes room by demoting its oldest
linked checkpoint to the host tier (one copy over PCIe), and the host tier evicts its oldest. On
the CPU path the device tier has no budget and host memory is the only tier. Evicting one unlinks
its node, and a node the tree evicts drops its checkpoint (the tree calls ``drop``), so no node
ever points at freed memory and no checkpoint outlives its KV.

A checkpoint is allocated blank and filled layer by layer through its sink while the forward that
reaches its position runs (models/state_cuts.py), or all at once from a state row (``take``).
What it holds is the state pool's to say (its ``checkpoint_parts``, ``read``, ``capture``,
``write``): a GDN model's conv and delta-rule states (engine/state_pool.py), or a sliding-window
model's last W positions of KV (engine/window_pool.py); this pool only moves named arrays.
Until linked it is pending: its request holds it, and it counts against the device budget (its
memory is held) but not the host one.
Shape legend: the state pools' (a checkpoint's parts are one state row's).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

DEVICE, HOST = "device", "host"
KEEP_SHARE = 0.25   # of the host budget: kept checkpoints beyond it are evicted like any other


@dataclass(eq=False)
class Checkpoint:
    position: int                # tokens consumed when it was taken
    parts: dict                  # name -> array on its tier, as the state pool's checkpoint_parts
    tier: str = HOST
    node: object = None          # the radix node it is linked to (None while pending)
    keep: bool = False           # the end of a prompt that ends a user query: evicted last

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.parts.values())


@dataclass
class Tier:
    budget: int
    lru: OrderedDict = field(default_factory=OrderedDict)   # linked checkpoints by id, oldest first
    bytes: int = 0               # of the linked ones


@dataclass
class Counters:
    taken: int = 0
    hits: int = 0
    evicted: int = 0
    dropped: int = 0             # unlinked because their KV prefix was evicted or never cached
    demoted: int = 0             # moved from the device tier to the host tier to make room
    reused_tokens: int = 0       # prompt tokens requests did not recompute thanks to a checkpoint


class CheckpointPool:
    def __init__(self, host_bytes: int, device_bytes: int = 0, ops=None):
        """ops: the backend (xp, to_host, to_device); None is numpy, where both tiers are host
        memory (the tests exercise demotion so)."""
        self.tiers = {DEVICE: Tier(int(device_bytes)), HOST: Tier(int(host_bytes))}
        self._xp = ops.xp if ops is not None else np
        self._to_host = ops.to_host if ops is not None else np.asarray
        self._to_device = ops.to_device if ops is not None else np.asarray
        self.device_held = 0     # bytes of device-tier checkpoints, pending ones included
        self._spare: list = []   # freed host parts (dicts of buffers), reused by the next host checkpoint
        self.counters = Counters()

    @property
    def budget(self) -> int:
        return sum(t.budget for t in self.tiers.values())

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.tiers.values())

    def blank(self, states, position: int) -> Checkpoint | None:
        """An unfilled checkpoint shaped like one state row of `states`, on the device tier when
        it has (or can make) room, else on the host; None when neither budget holds one."""
        spec = states.checkpoint_parts()                       # name -> (shape, dtype)
        one = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in spec.values())
        if self._room_on_device(one):
            self.device_held += one
            parts, tier = {name: self._xp.empty(shape, dtype) for name, (shape, dtype) in spec.items()}, DEVICE
        elif one <= self.tiers[HOST].budget:
            parts, tier = self._host_buffers(spec), HOST
        else:
            return None
        self.counters.taken += 1
        return Checkpoint(position, parts, tier)

    def sink(self, ckpt: Checkpoint, states):
        """sink(kind, j, state): copy what layer j's state (a device array: a GDN state row, a
        sliding layer's ring) holds at the checkpoint's position into its part `kind`."""
        def store(kind: str, j: int, state) -> None:
            value = states.capture(kind, j, state, ckpt.position)
            ckpt.parts[kind][j] = value if ckpt.tier == DEVICE else self._to_host(value)
        return store

    def take(self, states, row: int, position: int) -> Checkpoint | None:
        """A copy of state row `row` after `position` tokens (None when no budget holds one)."""
        ckpt = self.blank(states, position)
        if ckpt is not None:
            for name, value in states.read(row, position).items():
                ckpt.parts[name][...] = value if ckpt.tier == DEVICE else self._to_host(value)
        return ckpt

    def link(self, ckpt: Checkpoint, node) -> None:
        """Make `ckpt` the node's checkpoint (replacing an older one), then evict to the budget.
        The new one is counted before the old one is freed, so the old buffer is kept as a spare
        only if both fit the budget (the other order kept it beside the new one: 2 x a 1-checkpoint
        budget)."""
        old = node.checkpoint
        ckpt.node, node.checkpoint = node, ckpt
        tier = self.tiers[ckpt.tier]
        tier.lru[id(ckpt)] = ckpt
        tier.bytes += ckpt.nbytes
        if old is not None:
            ckpt.keep = ckpt.keep or old.keep                   # the same state, taken again
            self.drop(old)
        self._evict_host()

    def restore(self, ckpt: Checkpoint, states, row: int) -> None:
        move = (lambda a: a) if ckpt.tier == DEVICE else self._to_device
        states.write(row, ckpt.position, {name: move(a) for name, a in ckpt.parts.items()})
        self.tiers[ckpt.tier].lru.move_to_end(id(ckpt))
        self.counters.hits += 1
        self.counters.reused_tokens += ckpt.position

    def drop(self, ckpt: Checkpoint) -> None:
        """Unlink and free one checkpoint (its node is going away, or a newer one replaces it)."""
        if ckpt.tier is not None and id(ckpt) in self.tiers[ckpt.tier].lru:
            self._unlink(ckpt)
            self.counters.dropped += 1

    def discard(self, ckpt: Checkpoint) -> None:
        """Free a pending checkpoint that will never be linked (its position was never cached)."""
        assert ckpt.node is None, "discard is for pending checkpoints; linked ones are dropped"
        self._release(ckpt)
        self.counters.dropped += 1

    def clear(self) -> None:
        """Unlink and free every checkpoint (the tree they hang from is being replaced)."""
        for tier in self.tiers.values():
            for ckpt in list(tier.lru.values()):
                self._unlink(ckpt)
                self.counters.dropped += 1

    def _room_on_device(self, one: int) -> bool:
        """Demote the oldest linked device checkpoints until `one` more bytes fit the device budget."""
        tier = self.tiers[DEVICE]
        if one > tier.budget:
            return False
        while self.device_held + one > tier.budget and tier.lru:
            self._demote(next(iter(tier.lru.values())))
        return self.device_held + one <= tier.budget

    def _demote(self, ckpt: Checkpoint) -> None:
        device, host = self.tiers[DEVICE], self.tiers[HOST]
        del device.lru[id(ckpt)]
        device.bytes -= ckpt.nbytes
        self.device_held -= ckpt.nbytes
        parts = self._host_buffers({name: (a.shape, a.dtype) for name, a in ckpt.parts.items()})
        for name, a in ckpt.parts.items():
            parts[name][...] = self._to_host(a)
        ckpt.parts, ckpt.tier = parts, HOST
        host.lru[id(ckpt)] = ckpt          # newer than every host one: the device holds the recent
        host.bytes += ckpt.nbytes
        self.counters.demoted += 1
        self._evict_host()

    def _host_buffers(self, spec: dict) -> dict:
        """Host arrays of `spec` (name -> (shape, dtype)): a spare set when one is kept (one
        model's checkpoints all have the same parts)."""
        return self._spare.pop() if self._spare else {name: np.empty(shape, dtype) for name, (shape, dtype) in spec.items()}

    def _evict_host(self) -> None:
        host = self.tiers[HOST]
        while host.bytes > host.budget and host.lru:
            self._unlink(self._victim(host))
            self.counters.evicted += 1

    def _victim(self, host: Tier) -> Checkpoint:
        """The least recently used host checkpoint, passing over kept ones (query ends) while
        they hold at most KEEP_SHARE of the budget. A user query makes the template re-render
        what follows the previous one (bench/agent_edits.py: a second interjection 10 turns on
        needs the first one's state, which plain LRU at 32 checkpoints had evicted)."""
        kept = sum(c.nbytes for c in host.lru.values() if c.keep)
        if kept <= KEEP_SHARE * host.budget:
            for ckpt in host.lru.values():
                if not ckpt.keep:
                    return ckpt
        return next(iter(host.lru.values()))

    def _unlink(self, ckpt: Checkpoint) -> None:
        tier = self.tiers[ckpt.tier]
        del tier.lru[id(ckpt)]
        tier.bytes -= ckpt.nbytes
        if ckpt.node is not None and ckpt.node.checkpoint is ckpt:
            ckpt.node.checkpoint = None
        ckpt.node = None
        self._release(ckpt)

    def _release(self, ckpt: Checkpoint) -> None:
        """Give the checkpoint's memory back now, even if something still holds the object. A
        host buffer is kept for the next host checkpoint while linked plus spare bytes stay
        within the host budget: a fresh 60 MiB allocation is fresh pages from the kernel, and
        faulting them in cost 16-150 ms a checkpoint on the dev VM against 8 ms to fill reused
        ones (bench/checkpoint_cost.py)."""
        if ckpt.tier == DEVICE:
            self.device_held -= ckpt.nbytes
        elif ckpt.tier == HOST and self.tiers[HOST].bytes + (len(self._spare) + 1) * ckpt.nbytes <= self.tiers[HOST].budget:
            self._spare.append(ckpt.parts)
        ckpt.parts = {}
        ckpt.tier = None

    def linked(self) -> list[Checkpoint]:
        return [c for t in self.tiers.values() for c in t.lru.values()]

    def __len__(self) -> int:
        return sum(len(t.lru) for t in self.tiers.values())

    def status(self) -> dict:
        c = self.counters
        tiers = {name: {"checkpoints": len(t.lru), "bytes": t.bytes, "budget_bytes": t.budget}
                 for name, t in self.tiers.items()}
        return {"checkpoints": len(self), "bytes": self.bytes, "budget_bytes": self.budget, "tiers": tiers,
                "taken": c.taken, "hits": c.hits, "evicted": c.evicted, "dropped": c.dropped,
                "demoted": c.demoted, "reused_tokens": c.reused_tokens}
