"""The MoE layer runtime: one object behind `moe.forward(j, x, ids, weights, prefill)` (docs/contracts.md).

Backends (DESIGN §5.2): fused (experts_op on the layer's whole bank), offload (every miss filled
into the slot pool, then experts_op over the pool), cpu (every routed expert on the CPU from the
host bank; inline here, as there is no device to overlap with), hybrid (q of the m misses filled, the rest on the executor thread
while experts_op runs the resident ones; the two partial sums are added).

Prefill: the design streams whole layers through two buffers (§5.5). This host-only build has no
device memory to stream into, so offload and hybrid prefill run experts_op directly on the
layer's host bank (exactly the fused path), and
prefill never touches the residency state or the hit/miss counters (only `prefill_calls`).

Shape legend: T tokens, H hidden, E experts, k routed, I expert width, S slots, L MoE layers.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ConfigError, EngineConfig, ModelConfig
from freetoken.moe.executor import CpuExecutor, overflow_ids
from freetoken.moe.options import Log, cache_policy, cache_slots, choose_backend, prefill_as_decode
from freetoken.moe.pool import Bank, SlotPool, check_banks
from freetoken.moe.residency import COUNTERS, SlotCache
from freetoken.moe.split import FetchPolicy


class MoERuntime:
    """Runs the routed experts of every MoE layer with one backend, chosen at build time."""

    def __init__(self, backend: str, banks: list[Bank], experts_op, *, policy: FetchPolicy | None = None,
                 num_slots: int = 0, cpu_threads: int = 0):
        self.backend, self.banks, self._op, self.policy = backend, banks, experts_op, policy
        L, E = len(banks), banks[0].num_experts
        cached = backend in ("offload", "hybrid")
        self.cache = SlotCache(L, E, num_slots) if cached else None
        self.pool = SlotPool(num_slots, banks[0]) if cached else None
        # The cpu backend has nothing to overlap with in this host-only runtime, so it calls the
        # kernel inline: a hand-off to the executor thread measured 5-22% slower on 2 cores.
        needs_cpu = backend == "hybrid" and policy.kind != "all"
        self.executor = CpuExecutor(experts_op, cpu_threads) if needs_cpu else None
        self._counters = self.cache.counters if cached else {c: np.zeros(L, np.int64) for c in COUNTERS}
        self.prefill_calls = 0
        self.prefill_decode_tokens = 0      # build_moe sets --moe-prefill-decode-tokens

    def forward(self, j: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                prefill: bool = False) -> np.ndarray:
        """MoE layer j: x f32[T,H], ids int32[T,k] (not modified), weights f32[T,k] -> f32[T,H]."""
        if prefill and self.cache is not None and prefill_as_decode(
                ids, np, self.prefill_decode_tokens, self.cache.S):
            prefill = False
        if prefill:
            self.prefill_calls += 1
            return self._direct(j, x, ids, weights)
        if self.backend == "fused":
            self._count_uncached(j, ids, "hits")
            return self._direct(j, x, ids, weights)
        if self.backend == "cpu":
            self._count_uncached(j, ids, "misses", "cpu_execs")
            return self._direct(j, x, ids, weights)
        return self._decode_cached(j, x, ids, weights)

    def _direct(self, j, x, ids, weights):
        bank = self.banks[j]
        return self._op(x, ids, weights, bank.gate_up, bank.down)

    def _decode_cached(self, j, x, ids, weights):
        """Residency step, then CPU overflow on the executor thread alongside the slot-pool op."""
        slots = np.array(ids, dtype=np.int32, copy=True)
        fills = self.cache.step(j, slots, self.policy)
        cpu_ids = overflow_ids(ids, slots)
        on_cpu = bool((cpu_ids >= 0).any())
        bank = self.banks[j]
        if on_cpu:                                   # first, so it overlaps the copy and the pool op
            self.executor.submit(x, cpu_ids, weights, bank.gate_up, bank.down)
        try:
            self.pool.fill(bank, fills)              # stands in for the host -> device copy
            out = self._op(x, slots, weights, self.pool.gate_up, self.pool.down)
        finally:
            partial = self.executor.wait() if on_cpu else None   # never leave a job in flight
        if partial is not None:
            out += partial
        return out

    def _count_uncached(self, j: int, ids: np.ndarray, *names: str) -> None:
        distinct = len(np.unique(ids))
        for name in names:
            self._counters[name][j] += distinct

    def stats(self) -> dict:
        """Backend, slots, policy, per-layer and total counters (distinct experts per layer-step)."""
        per_layer = [{c: int(self._counters[c][j]) for c in COUNTERS} for j in range(len(self.banks))]
        total = {c: int(self._counters[c].sum()) for c in COUNTERS}
        routed = total["hits"] + total["misses"]
        total["miss_rate"] = total["misses"] / routed if routed else 0.0
        return {
            "backend": self.backend,
            "slots": self.cache.S if self.cache else 0,
            "policy": self.policy.describe() if self.policy else None,
            "layers": per_layer,
            "total": total,
            "prefill_calls": self.prefill_calls,
        }

    def reset(self) -> None:
        """Cold residency (slot bytes untouched: no slot is read before it is filled) and zero counters."""
        if self.cache is not None:
            self.cache.reset()
        for c in self._counters.values():
            c.fill(0)
        self.prefill_calls = 0

    def close(self) -> None:
        """Join the executor thread; idempotent."""
        if self.executor is not None:
            self.executor.close()

    def __enter__(self) -> "MoERuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_moe(cfg: ModelConfig, banks, engine_config: EngineConfig, experts_op, log=None, *,
              profile_phi: float | None = None, gpu: bool = False) -> MoERuntime:
    """Pick the backend, size the cache and the fetch policy, and build the runtime.

    banks: one (gate_up [E,2I,H], down [E,H,I]) per MoE layer, in cfg.moe_layers order.
    experts_op: the `experts` op (contract signature). log: a Logger or a callable(msg).
    profile_phi: phi from the bandwidth profile, if one was found. gpu: a device is in use.
    """
    log = Log(log)
    banks = check_banks(banks, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    if len(banks) != len(cfg.moe_layers):
        raise ConfigError(f"{len(banks)} expert banks for {len(cfg.moe_layers)} MoE layers")
    ec = engine_config
    backend = choose_backend(ec.moe_backend, log, gpu=gpu)
    if backend in ("fused", "cpu"):
        return MoERuntime(backend, banks, experts_op, cpu_threads=ec.moe_cpu_threads)
    slots = cache_slots(len(banks), cfg.num_experts, cfg.num_experts_per_tok, ec, log)
    policy = cache_policy(backend, ec, log, profile_phi)
    log.info(f"moe {backend}: {slots} expert slots for {len(banks)} layers x {cfg.num_experts} experts")
    moe = MoERuntime(backend, banks, experts_op, policy=policy, num_slots=slots,
                     cpu_threads=ec.moe_cpu_threads)
    moe.prefill_decode_tokens = ec.moe_prefill_decode_tokens
    return moe
