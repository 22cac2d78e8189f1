"""The residency state on a device, behind one interface with two implementations.

``GpuResidency`` keeps the residency state (docs/design.md, The residency step) in device arrays
and runs the residency step as one kernel per MoE layer call (cuda/residency.cu), bit-identical
to ``SlotCache.step`` (residency.py, the spec). The fill plan (slots, experts, count) stays on
the device, so the copies that follow read it there and need no host round trip. ``HostResidency`` is the same interface over the spec
itself, with numpy "device" arrays: it is how CI runs the device runtime without a GPU.

Both: ``step(layer, slots, cpu_ids, policy)`` (slots int32[T,k] holds the routed ids and is
rewritten to slot or -1; cpu_ids gets the expert where the rewrite gave -1, else -1),
``fill(host, pool)`` (copies the last step's plan), ``load_layer(...)`` (prefill), ``invalidate(lo,
hi)``, ``count_routed(layer, ids, cols)``, ``reset()``, ``counters_host()`` int64[L,5] in COUNTERS
order, ``snapshot()`` (numpy copies of the state, for tests).

Shape legend: T tokens, k routed, L MoE layers, E experts, S slots.
"""
from __future__ import annotations

import numpy as np

from freetoken.moe.executor import overflow_ids
from freetoken.moe.residency import COUNTERS, Fills, SlotCache
from freetoken.moe.split import FetchPolicy
from freetoken.cupy_loader import cupy as load_cupy

_STORAGE = (("bf16", "u16*"), ("f32", "f32*"), ("u8", "u8*"))   # u8: quantized blocks
ARGS = {  # launch order of each entry point of cuda/residency.cu
    "residency_step_i32": (
        "ids:i32*", "cpu_ids:i32*", "P:i32", "layer:i32", "E:i32", "S:i32", "slot_for:i32*",
        "owner_of:i32*", "usage:i64*", "recency:i64*", "clock:i64*", "counters:i64*",
        "fill_slots:i32*", "fill_experts:i32*", "fill_count:i32*", "kind:i32", "frac_q16:i32",
        "cap:i32", "min_fill:i32", "order:i32"),
    "residency_invalidate_i32": ("slot_for:i32*", "owner_of:i32*", "usage:i64*", "lo:i32", "hi:i32"),
    "residency_count_i32": ("ids:i32*", "P:i32", "layer:i32", "E:i32", "counters:i64*",
                            "col_a:i32", "col_b:i32"),
    **{f"fill_rows_{t}": (f"host_gate_up:{p}", f"host_down:{p}", f"pool_gate_up:{p}",
                          f"pool_down:{p}", "fill_slots:i32*", "fill_experts:i32*",
                          "fill_count:i32*", "rows:i32", "chunks:i32", "gu_row:i64", "dn_row:i64",
                          "gu_slot:i64", "dn_slot:i64")
       for t, p in _STORAGE},
    **{f"prefill_load_{t}": (f"host_gate_up:{p}", f"host_down:{p}", f"pool_gate_up:{p}",
                             f"pool_down:{p}", "slot_for_layer:i32*", "rows:i32", "chunks:i32",
                             "dst0:i32", "keep_lo:i32", "gu_row:i64", "dn_row:i64",
                             "gu_slot:i64", "dn_slot:i64")
       for t, p in _STORAGE},
}
RES_THREADS = 256            # residency.cu's one block
MAX_EXPERTS = 4096           # 3*E ints of dynamic shared memory must fit in 48 KiB
KINDS = {"fraction": 0, "cap": 1, "all": 2}
ORDERS = {"recency": 0, "lowest_id": 1}
COPY_THREADS = 256
# The copy kernels share the SMs with the compute stream: a fixed grid of COPY_BLOCKS blocks, each
# keeping 256 threads x 4 x 16 B = 16 KiB of loads in flight (64 blocks: 1 MiB, far more than a
# PCIe link's bandwidth-latency product), loops over (row, bank, chunk) items of CHUNK_BYTES.
# `bench bw` measures B_P through this path; raise COPY_BLOCKS if it is well below the link.
COPY_BLOCKS = 64
CHUNK_BYTES = 256 << 10


def policy_args(policy: FetchPolicy) -> dict:
    """The policy as the kernel's integer arguments; the Q16 count itself is done on the device."""
    return dict(kind=KINDS[policy.kind], frac_q16=policy.frac_q16, cap=min(policy.cap, 2**31 - 1),
                min_fill=policy.min_fill, order=ORDERS[getattr(policy, "order", "recency")])


def invalidate_mirror(cache: SlotCache, lo: int, hi: int) -> None:
    """Spec of residency_invalidate: slots [lo, hi) lose their owner and become the coldest."""
    for s in range(lo, min(hi, cache.S)):
        old = int(cache.owner_of[s])
        if old >= 0:
            cache.slot_for[old // cache.E, old % cache.E] = -1
        cache.owner_of[s] = -1
        cache.usage[s] = 0


def _chunks(row_elems: int, itemsize: int) -> int:
    return max(1, -(-row_elems * itemsize // CHUNK_BYTES))


class GpuResidency:
    """Device residency state of L layers x E experts over S slots (CuPy arrays, current stream)."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        cp = load_cupy()
        if not 1 <= num_experts <= MAX_EXPERTS or min(num_layers, num_slots) < 1:
            raise ValueError(f"GpuResidency: need L, S >= 1 and 1 <= E <= {MAX_EXPERTS}, got "
                             f"{num_layers}, {num_experts}, {num_slots}")
        self.L, self.E, self.S = num_layers, num_experts, num_slots
        self.slot_for = cp.empty((self.L, self.E), cp.int32)
        self.owner_of = cp.empty(self.S, cp.int32)
        self.usage = cp.empty(self.S, cp.int64)
        self.recency = cp.empty((self.L, self.E), cp.int64)
        self.clock = cp.empty(1, cp.int64)
        self.counters = cp.empty((self.L, len(COUNTERS)), cp.int64)
        self.fill_slots = cp.zeros(self.E, cp.int32)      # the copy plan, read by fill_rows
        self.fill_experts = cp.zeros(self.E, cp.int32)
        self.fill_count = cp.zeros(1, cp.int32)
        self.max_rows = 0                                   # upper bound of the last plan's rows
        self.reset()

    def reset(self) -> None:
        """Cold cache, clock 0, recency forgotten, counters zeroed (slot bytes untouched)."""
        for a, v in ((self.slot_for, -1), (self.owner_of, -1), (self.usage, 0), (self.recency, -1),
                     (self.clock, 0), (self.counters, 0), (self.fill_count, 0)):
            a.fill(v)

    def step(self, layer: int, slots, cpu_ids, policy: FetchPolicy) -> None:
        """One residency step on the current stream; slots int32[T,k] in place, cpu_ids written."""
        from freetoken.kernels import _cuda
        assert 0 <= layer < self.L and slots.shape == cpu_ids.shape and slots.ndim == 2
        P = slots.size
        args = _cuda.bind(ARGS["residency_step_i32"], ids=slots, cpu_ids=cpu_ids, P=P, layer=layer,
                          E=self.E, S=self.S, slot_for=self.slot_for, owner_of=self.owner_of,
                          usage=self.usage, recency=self.recency, clock=self.clock,
                          counters=self.counters, fill_slots=self.fill_slots,
                          fill_experts=self.fill_experts, fill_count=self.fill_count,
                          **policy_args(policy))
        _cuda.launch(_cuda.kernel("residency", "residency_step_i32"), (1,), (RES_THREADS,), args,
                     shared_mem=3 * 4 * self.E)
        self.max_rows = min(P, self.E, self.S)      # a step fills at most S - hits slots

    def fill(self, host, pool) -> None:
        """Copy the last plan's rows host bank -> pool slots on the current stream.
        host, pool: (gate_up, down) pairs; host is the layer's mapped pinned bank."""
        self._copy("fill_rows", max(1, self.max_rows), host, pool, fill_slots=self.fill_slots,
                   fill_experts=self.fill_experts, fill_count=self.fill_count)

    def load_layer(self, layer: int, first: int, n: int, host, pool, dst0: int, keep_lo: int) -> None:
        """Experts [first, first+n) of the layer -> slots [dst0, dst0+n); resident copies in slots
        >= keep_lo are copied device to device. host: the layer's (gate_up, down) bank views."""
        row = self.slot_for[layer, first:first + n]
        host = (host[0][first:first + n], host[1][first:first + n])
        touches = [(p[dst0:dst0 + n], True) for p in pool] + [(p[keep_lo:], False) for p in pool]
        self._copy("prefill_load", n, host, pool, touches, slot_for_layer=row, dst0=dst0, keep_lo=keep_lo)

    def _copy(self, entry: str, rows: int, host, pool, touches=(), **plan) -> None:
        from freetoken.kernels import _cuda
        name = f"{entry}_{_cuda.dtype_tag(pool[0])}"
        # a row is one expert as the layer stores it; a slot may be wider (pool.slot_views)
        gu_row, dn_row = pool[0][0].size, pool[1][0].size
        gu_slot, dn_slot = (p.strides[0] // p.itemsize for p in pool)
        chunks = _chunks(gu_row, pool[0].itemsize)
        args = _cuda.bind(ARGS[name], host_gate_up=host[0], host_down=host[1],
                          pool_gate_up=_cuda.flat_span(pool[0]),
                          pool_down=_cuda.flat_span(pool[1]),
                          rows=rows, chunks=chunks, gu_row=gu_row, dn_row=dn_row, gu_slot=gu_slot,
                          dn_slot=dn_slot, **plan)
        grid = (min(COPY_BLOCKS, rows * 2 * chunks),)
        _cuda.launch(_cuda.kernel("residency", name), grid, (COPY_THREADS,), args, touches=touches)

    def invalidate(self, lo: int, hi: int) -> None:
        from freetoken.kernels import _cuda
        hi = min(hi, self.S)
        if hi <= lo:
            return
        args = _cuda.bind(ARGS["residency_invalidate_i32"], slot_for=self.slot_for,
                          owner_of=self.owner_of, usage=self.usage, lo=lo, hi=hi)
        _cuda.launch(_cuda.kernel("residency", "residency_invalidate_i32"),
                     (-(-(hi - lo) // 256),), (256,), args)

    def count_routed(self, layer: int, ids, cols: tuple[str, ...]) -> None:
        """Add the layer-step's distinct routed experts to the named counters (fused, cpu)."""
        from freetoken.kernels import _cuda
        idx = [COUNTERS.index(c) for c in cols]
        a, b = idx[0], (idx[1] if len(idx) > 1 else -1)
        args = _cuda.bind(ARGS["residency_count_i32"], ids=ids, P=ids.size, layer=layer, E=self.E,
                          counters=self.counters, col_a=a, col_b=b)
        _cuda.launch(_cuda.kernel("residency", "residency_count_i32"), (1,), (RES_THREADS,), args,
                     shared_mem=4 * self.E)

    def counters_host(self) -> np.ndarray:
        return self.counters.get()

    def snapshot(self) -> dict:
        names = ("slot_for", "owner_of", "usage", "recency", "counters")
        snap = {n: getattr(self, n).get() for n in names}
        snap["clock"] = int(self.clock.get()[0])
        count = int(self.fill_count.get()[0])
        snap["fills"] = (self.fill_slots[:count].get(), self.fill_experts[:count].get())
        return snap


class HostResidency:
    """The same interface over the numpy spec (SlotCache): the "device" is the host."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        self.cache = SlotCache(num_layers, num_experts, num_slots)
        self.L, self.E, self.S = num_layers, num_experts, num_slots
        self.plan = Fills(np.empty(0, np.int32), np.empty(0, np.int32))

    def reset(self) -> None:
        self.cache.reset()
        self.plan = Fills(np.empty(0, np.int32), np.empty(0, np.int32))

    def step(self, layer: int, slots, cpu_ids, policy: FetchPolicy) -> None:
        raw = slots.copy()
        self.plan = self.cache.step(layer, slots, policy)
        cpu_ids[...] = overflow_ids(raw, slots)

    def fill(self, host, pool) -> None:
        for slot, expert in zip(self.plan.slots.tolist(), self.plan.experts.tolist()):
            pool[0][slot] = host[0][expert]
            pool[1][slot] = host[1][expert]

    def load_layer(self, layer: int, first: int, n: int, host, pool, dst0: int, keep_lo: int) -> None:
        for e in range(first, first + n):
            s = int(self.cache.slot_for[layer, e])
            for bank in (0, 1):
                pool[bank][dst0 + e - first] = pool[bank][s] if s >= keep_lo else host[bank][e]

    def invalidate(self, lo: int, hi: int) -> None:
        invalidate_mirror(self.cache, lo, hi)

    def count_routed(self, layer: int, ids, cols: tuple[str, ...]) -> None:
        # router ids, always in [0, E) here; a decode step's few through a set (np.unique's
        # sort cost 10-15 us a layer there)
        distinct = len(set(ids.ravel().tolist())) if ids.size <= 256 else len(np.unique(ids))
        for c in cols:
            self.cache.counters[c][layer] += distinct

    def counters_host(self) -> np.ndarray:
        return np.stack([self.cache.counters[c] for c in COUNTERS], axis=1)

    def snapshot(self) -> dict:
        c = self.cache
        return {"slot_for": c.slot_for.copy(), "owner_of": c.owner_of.copy(), "usage": c.usage.copy(),
                "recency": c.recency.copy(), "counters": self.counters_host(), "clock": c.clock,
                "fills": (self.plan.slots.copy(), self.plan.experts.copy())}
