"""The MoE runtime on a device (DESIGN §5): the interface of MoERuntime (forward, stats, reset,
close, plus rebuild) for offload, hybrid, cpu and fused, with the slot pool in device memory.

Decode, offload and hybrid, per MoE layer call, all enqueued without waiting on the device:
1. the caller's ids are copied to a scratch array and the residency kernel rewrites them to slot
   or -1 (and writes the CPU ids and the fill plan) on the compute stream;
2. hybrid: x, the CPU ids and the weights are staged to pinned host buffers (cpu_branch.py);
3. the fill plan's rows are copied host pool -> slots on the copy stream, which waits for the
   residency kernel (so no expert still read by the previous layer is overwritten) and which the
   compute stream then waits for;
4. the experts op runs over the slot pool; -1 rows contribute nothing (the op masks them);
5. hybrid: only now the host waits for the staging copy, runs the -1 pairs on the CPU from the
   host pool while the GPU works through 3-4, and adds the partial sum on the compute stream.
Offload never waits on the device, so its calls queue up ahead of the GPU.

cpu: every routed expert on the CPU (stage, run, copy back). fused: every expert resident. Prefill
streams whole layers through the slot pool (prefill.py); the cpu backend borrows a pool of 2E
slots for that (upstream does the same), unless the host pool is not pinned (then prefill runs on
the CPU too). Counters live on the device and are read only by stats().

Shape legend: T tokens, H hidden, E experts, k routed, I expert width, S slots, L MoE layers.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ConfigError, EngineConfig, ModelConfig
from freetoken.moe.cpu_branch import HANDOFF_MODE, CpuBranch, measure_handoff
from freetoken.moe.host_pool import HostPool, pin_host_pool
from freetoken.moe.options import Log, cache_policy, cache_slots, prefill_as_decode
from freetoken.moe.pool import Bank, check_banks
from freetoken.moe.prefill import PrefillStreamer, overlap_ok
from freetoken.moe.residency import COUNTERS
from freetoken.moe.split import FetchPolicy

__all__ = ["GpuMoERuntime", "build_gpu_moe", "measure_handoff"]   # the bench times the hand-off


class GpuMoERuntime:
    """Routed experts of every MoE layer on a device `dev` (moe/device.py), one backend."""

    def __init__(self, backend: str, host: HostPool, dev, experts_op, cpu_op, *,
                 policy: FetchPolicy | None = None, num_slots: int = 0, cpu_threads: int = 0,
                 disable_overlap: bool = False, handoff: str = HANDOFF_MODE, log=None):
        self.backend, self.host, self.dev, self.policy = backend, host, dev, policy
        self._op, self._log, self._disable_overlap = experts_op, log, disable_overlap   # raw sink
        self.L, self.E = host.num_layers, host.banks[0].num_experts
        self.cached = backend in ("offload", "hybrid")
        self.resident = ([(dev.to_device(b.gate_up), dev.to_device(b.down)) for b in host.banks]
                         if backend == "fused" else None)
        needs_cpu = backend == "cpu" or (backend == "hybrid" and policy.kind != "all")
        self.branch = CpuBranch(dev, cpu_op, cpu_threads, handoff) if needs_cpu else None
        self._planned, self._filled = dev.event(), dev.event()
        self._scratch: dict[tuple, tuple] = {}
        self.prefill_calls = 0
        self.prefill_decode_tokens = 0      # build_gpu_moe sets --moe-prefill-decode-tokens
        self._allocate(num_slots)

    def _pool_slots(self, num_slots: int) -> int:
        if self.cached:
            return num_slots
        if self.backend == "cpu" and (self.host.pinned or not self.dev.needs_pinning):
            return (1 if self._disable_overlap else 2) * self.E   # prefill only
        return 0

    def _allocate(self, num_slots: int) -> None:
        """Slot pool (zeroed: pitfall 4), residency state, prefill streamer for num_slots."""
        S, xp, like = self._pool_slots(num_slots), self.dev.xp, self.host.banks[0]
        self.num_slots = num_slots if self.cached else 0
        self.res = self.dev.residency(self.L, self.E, max(S, 1))   # S = 0: counters only
        self.pool, self.streamer = None, None
        if S:
            self.pool = (xp.zeros((S,) + like.gate_up.shape[1:], like.gate_up.dtype),
                         xp.zeros((S,) + like.down.shape[1:], like.down.dtype))
            overlap = overlap_ok(S, self.E, self._disable_overlap, self._log)
            self.streamer = PrefillStreamer(self.dev, self.res, self.pool, self.host, overlap)

    def forward(self, j: int, x, ids, weights, prefill: bool = False):
        """MoE layer j: x f32[T,H], ids int32[T,k] (not modified), weights f32[T,k] -> f32[T,H]."""
        if prefill and self.cached and prefill_as_decode(
                ids, self.dev.xp, self.prefill_decode_tokens, self.num_slots):
            prefill = False            # a short chunk: through the expert cache, like decode
        if prefill:
            self.prefill_calls += 1
            if self.resident is not None:
                return self._experts(x, ids, weights, *self.resident[j])
            if self.streamer is None:                  # pageable host pool: all on the CPU
                return self.branch.run_all(x, ids, weights, self.host.host(j))
            return self.streamer.run(j, x, ids, weights, self._experts)
        if self.backend == "fused":
            self.res.count_routed(j, ids, ("hits",))
            return self._experts(x, ids, weights, *self.resident[j])
        if self.backend == "cpu":
            self.res.count_routed(j, ids, ("misses", "cpu_execs"))
            return self.branch.run_all(x, ids, weights, self.host.host(j))
        return self._decode_cached(j, x, ids, weights)

    def _experts(self, x, ids, weights, gate_up, down):
        """The experts op into a fresh f32[T,H] (GPU wrappers take a preallocated out)."""
        out = self.dev.xp.empty((x.shape[0], x.shape[1]), np.float32)
        return self._op(x, ids, weights, gate_up, down, out)

    def _ids_scratch(self, shape) -> tuple:
        if shape not in self._scratch:
            xp = self.dev.xp
            self._scratch[shape] = (xp.empty(shape, np.int32), xp.empty(shape, np.int32))
        return self._scratch[shape]

    def _decode_cached(self, j, x, ids, weights):
        slots, cpu_ids = self._ids_scratch(tuple(ids.shape))
        slots[...] = ids                               # the caller's ids stay as they were
        self.res.step(j, slots, cpu_ids, self.policy)
        self._start_fill(j)                            # the copy stream starts at once
        staged = self.branch.stage(x, cpu_ids, weights) if self.branch else None
        self.dev.wait(self._filled)                    # after the staging copy: not behind the fills
        out = self._experts(x, slots, weights, self.pool[0], self.pool[1])
        if staged is not None:
            self.branch.finish(staged, self.host.host(j), out)
        return out

    def _start_fill(self, j: int) -> None:
        """The last step's fill plan, host pool -> slots, on the copy stream after the residency
        kernel; `_filled` is recorded when it is done (the compute stream waits for it)."""
        dev = self.dev
        dev.record(self._planned)
        dev.wait(self._planned, on_copy=True)
        with dev.copy_stream():
            self.res.fill(dev.host_views(self.host, j), self.pool)
        dev.record(self._filled, on_copy=True)

    def stats(self) -> dict:
        """MoERuntime.stats() plus device facts; reads the device counters (a sync)."""
        counters = self.res.counters_host()
        per_layer = [{c: int(counters[j, i]) for i, c in enumerate(COUNTERS)} for j in range(self.L)]
        total = {c: int(counters[:, i].sum()) for i, c in enumerate(COUNTERS)}
        routed = total["hits"] + total["misses"]
        total["miss_rate"] = total["misses"] / routed if routed else 0.0
        return {
            "backend": self.backend, "slots": self.num_slots,
            "policy": self.policy.describe() if self.policy else None,
            "layers": per_layer, "total": total, "prefill_calls": self.prefill_calls,
            "device": self.dev.name, "host_pinned": self.host.pinned,
            "prefill_overlap": bool(self.streamer and self.streamer.overlap),
            "prefill_loads": self.streamer.loads if self.streamer else 0,
            "cpu_calls": self.branch.calls if self.branch else 0,
        }

    def reset(self) -> None:
        """Cold residency and zero counters; slot bytes untouched (no slot is read unfilled)."""
        self.res.reset()
        if self.streamer is not None:
            self.streamer.reset()
        self.prefill_calls = 0
        if self.branch is not None:
            self.branch.calls = 0

    def rebuild(self, num_slots: int) -> None:
        """New slot pool of num_slots at a safe point (no call in flight): the old pool is freed
        first (the device may not hold both), the host pool is kept; cold cache, zero counters.
        On failure the old size is allocated again and the error re-raised."""
        if not self.cached:
            raise ConfigError(f"the {self.backend} MoE backend has no expert cache to resize")
        if num_slots < 1:
            raise ConfigError(f"expert cache of {num_slots} slots: need at least one")
        old = self.num_slots
        self.pool = self.streamer = self.res = None
        self._scratch.clear()
        self.dev.free_cached()
        try:
            self._allocate(num_slots)
        except Exception:
            self.dev.free_cached()
            self._allocate(old)
            raise
        self.prefill_calls = 0

    def close(self) -> None:
        """Join the CPU worker and drop device arrays; idempotent. The host pool stays (rebuilds
        and new runtimes reuse it); HostPool.close() unpins it."""
        if self.branch is not None:
            self.branch.close()
        self.pool = self.streamer = self.resident = None

    def __enter__(self) -> "GpuMoERuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_gpu_moe(cfg: ModelConfig, banks, engine_config: EngineConfig, experts_op, log=None, *,
                  backend: str, dev=None, cpu_op=None, profile_phi: float | None = None,
                  handoff: str = HANDOFF_MODE) -> GpuMoERuntime:
    """Device runtime for an already decided backend (profile.decide_backend resolves auto).

    banks: a HostPool (reused across rebuilds) or one (gate_up, down) per MoE layer, pinned here
    when the backend reads the host pool. A pool that cannot be pinned turns every backend but
    fused into cpu (WARN). dev: moe/device.py (default CudaDevice). cpu_op: the CPU experts op
    (default kernels.experts.cpu). profile_phi: phi of the bandwidth profile (profile.phi)."""
    from freetoken.moe.device import CudaDevice
    sink, log, ec = log, Log(log), engine_config       # helpers get the raw sink (Log(Log) fails)
    dev = dev if dev is not None else CudaDevice()
    if cpu_op is None:
        from freetoken.kernels.experts import cpu as cpu_op
    host = banks if isinstance(banks, HostPool) else None
    raw = host.banks if host else [b if isinstance(b, Bank) else Bank(*b) for b in banks]
    check_banks([(b.gate_up, b.down) for b in raw], cfg.num_experts, cfg.hidden_size,
                cfg.moe_intermediate_size)
    if len(raw) != len(cfg.moe_layers):
        raise ConfigError(f"{len(raw)} expert banks for {len(cfg.moe_layers)} MoE layers")
    slots, policy = 0, None               # sized before pinning: a bad flag fails in a second
    if backend in ("offload", "hybrid"):
        slots = cache_slots(len(raw), cfg.num_experts, cfg.num_experts_per_tok, ec, log)
        policy = cache_policy(backend, ec, log, profile_phi)
    if host is None:
        pin = backend != "fused" and dev.needs_pinning
        host = pin_host_pool(raw, sink) if pin else HostPool.pageable(raw)
    if backend in ("offload", "hybrid") and dev.needs_pinning and not host.pinned:
        log.warn(f"moe {backend} needs a pinned host expert pool; falling back to --moe-backend cpu")
        backend, slots, policy = "cpu", 0, None
    where = f"moe {backend} on {dev.name}"
    log.info(f"{where}: {slots} expert slots for {len(raw)} layers x {cfg.num_experts} experts"
             if slots else where)
    moe = GpuMoERuntime(backend, host, dev, experts_op, cpu_op, policy=policy, num_slots=slots,
                        cpu_threads=ec.moe_cpu_threads, handoff=handoff, log=sink,
                        disable_overlap=ec.disable_moe_prefill_overlap)
    moe.prefill_decode_tokens = ec.moe_prefill_decode_tokens
    return moe
