"""The MoE layer runtime: one object behind `moe.forward(j, x, ids, weights, prefill)`
(docs/contracts.md) for every backend (docs/moe.md), over a device `dev` (moe/device.py). The CPU
engine runs it over HostDevice (numpy), the CUDA engine over CudaDevice (CuPy; with
FREETOKEN_CUDA_EMULATE=1 that is the emulated device, on the CPU).

Decode, offload and hybrid, per MoE layer call, all enqueued without waiting on the device:
1. the caller's ids are copied to a scratch array and the residency step rewrites them to slot
   or -1 (and writes the CPU ids and the fill plan) on the compute stream;
2. hybrid: the CPU branch starts (cpu_branch.py). On a discrete device it stages x, the CPU ids and
   the weights to pinned host buffers; on a host-memory device it hands the -1 pairs to the
   executor thread at once, so that they overlap the fills and the slot-pool op of 3-4;
3. the fill plan's rows are copied host pool -> slots on the copy stream, which waits for the
   residency step (so no expert still read by the previous layer is overwritten) and which the
   compute stream then waits for;
4. the experts op runs over the slot pool; -1 rows contribute nothing (the op masks them);
5. hybrid: the CPU branch finishes. On a discrete device only now the host waits for the staging
   copy and runs the -1 pairs, while the device works through 3-4; the partial sum is added on the
   compute stream. Offload never waits on the device, so its calls queue up ahead of it.

cpu: every routed expert on the CPU from the host pool (inline on a host-memory device: there is
nothing to overlap with). fused: every expert resident on the device.

Prefill: on a discrete device whole layers stream through the slot pool (prefill.py); the cpu
backend borrows 2E slots for that (upstream does the same), unless the host pool is not pinned
(then prefill runs on the CPU too). A host-memory device holds every expert already, so there
prefill of every backend runs the experts op on the layer's host bank (streaming it through the
slot pool would be pure copying) and leaves the residency state alone. Prefill counts only
`prefill_calls`. Counters live in the device's residency state and are read only by stats().

Shape legend: T tokens, H hidden, E experts, k routed, I expert width, S slots, L MoE layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.config import ConfigError, ModelConfig
from freetoken.moe.cpu_branch import HANDOFF_MODE, make_cpu_branch
from freetoken.moe.device import HostDevice
from freetoken.moe.host_pool import HostPool, pin_host_pool
from freetoken.moe.pool import Bank, check_banks, quantized_slot_bytes, slot_pool, slot_views
from freetoken.log import Log
from freetoken.moe.prefill import PrefillStreamer, overlap_ok, prefill_as_decode
from freetoken.moe.residency import COUNTERS
from freetoken.moe.split import FetchPolicy

BACKENDS = ("fused", "offload", "cpu", "hybrid")
CACHED = ("offload", "hybrid")


@dataclass(frozen=True)
class MoEPlan:
    """What the start-up plan (engine/plan.py) settled for the MoE runtime."""

    backend: str                          # one of BACKENDS
    slots: int = 0                        # expert-cache slots S (offload, hybrid)
    policy: FetchPolicy | None = None     # which misses a layer-step fetches (offload, hybrid)
    cpu_threads: int | None = None        # CPU expert executor threads (None: numba's count)
    disable_prefill_overlap: bool = False
    prefill_decode_tokens: int = 32       # shorter prefill chunks run through the cache like decode


class MoERuntime:
    """Routed experts of every MoE layer on a device `dev` (moe/device.py), with one backend.

    host: the HostPool; experts_op: the device's `experts` op; cpu_op: the CPU one (the CPU
    branch's). handoff: the CPU branch's mode on a discrete device (cpu_branch.HANDOFF_MODES)."""

    def __init__(self, backend: str, host: HostPool, dev, experts_op, cpu_op, *,
                 policy: FetchPolicy | None = None, num_slots: int = 0, cpu_threads: int = 0,
                 disable_overlap: bool = False, handoff: str = HANDOFF_MODE, log=None, extras=None,
                 cpu_extras=None):
        self.backend, self.host, self.dev, self.policy = backend, host, dev, policy
        self._extras = extras or [{}] * host.num_layers   # per layer: the experts op's bias / glu keywords
        self._cpu_extras = cpu_extras or self._extras     # the same for the CPU branch (host arrays)
        self._op, self._log, self._disable_overlap = experts_op, log, disable_overlap   # raw sink
        self.L, self.E = host.num_layers, host.banks[0].num_experts
        self.cached = backend in CACHED
        self.resident = _resident(backend, host, dev)
        needs_cpu = backend == "cpu" or (backend == "hybrid" and policy.kind != "all")
        self.branch = (make_cpu_branch(dev, cpu_op, cpu_threads, handoff, overlap=self.cached)
                       if needs_cpu else None)
        self._planned, self._filled = dev.event(), dev.event()
        self._scratch: dict[tuple, tuple] = {}
        self.prefill_calls = 0
        self.prefill_decode_tokens = 0      # build_moe sets --moe-prefill-decode-tokens
        self._allocate(num_slots)

    def _pool_slots(self, num_slots: int) -> int:
        if self.cached:
            return num_slots
        streams = self.resident is None and (self.host.pinned or not self.dev.needs_pinning)
        if self.backend == "cpu" and streams:
            return prefill_stream_slots(self.E, self._disable_overlap)
        return 0

    def _allocate(self, num_slots: int) -> None:
        """Slot pool (zeroed, so a slot read before its first fill holds no NaN), residency state, prefill streamer for num_slots."""
        S = self._pool_slots(num_slots)
        self.num_slots = num_slots if self.cached else 0
        self.res = self.dev.residency(self.L, self.E, max(S, 1))   # S = 0: counters only
        self.pool, self.streamer = None, None
        if S:
            self.pool = slot_pool(self.dev.xp, S, self.host.banks)
        if S and self.resident is None:
            overlap = overlap_ok(S, self.E, self._disable_overlap, self._log)
            self.streamer = PrefillStreamer(self.dev, self.res, self.slots, self.host, overlap)

    def slots(self, j: int) -> tuple:
        """The slot pool as MoE layer j reads it (pool.slot_views: the pool itself unless quantized)."""
        return slot_views(self.pool, self.host.banks[j])

    def forward(self, j: int, x, ids, weights, prefill: bool = False):
        """MoE layer j: x f32[T,H], ids int32[T,k] (not modified), weights f32[T,k] -> f32[T,H]."""
        if prefill and self.cached and prefill_as_decode(
                ids, self.dev.xp, self.prefill_decode_tokens, self.num_slots):
            prefill = False            # a short chunk: through the expert cache, like decode
        if prefill:
            return self._prefill(j, x, ids, weights)
        if self.backend == "fused":
            self.res.count_routed(j, ids, ("hits",))
            return self._experts(x, ids, weights, *self.resident[j], **self._extras[j])
        if self.backend == "cpu":
            self.res.count_routed(j, ids, ("misses", "cpu_execs"))
            return self.branch.run_all(x, ids, weights, self.host.host(j), self._cpu_extras[j])
        return self._decode_cached(j, x, ids, weights)

    def inline_bank(self, j: int, prefill: bool):
        """Layer j's host bank (gate_up, down) when a decode step's experts run on the CPU in
        place (the cpu backend), for a caller that runs them inside its own kernel call
        (kernels/decode_layer.py) and then reports the route with routed_inline; else None."""
        return None if prefill or self.backend != "cpu" else self.host.host(j)

    def routed_inline(self, j: int, ids) -> None:
        """The counters of forward() for the route a caller ran itself on inline_bank(j)."""
        self.res.count_routed(j, ids, ("misses", "cpu_execs"))
        self.branch.calls += 1

    def _prefill(self, j: int, x, ids, weights):
        self.prefill_calls += 1
        if self.resident is not None:
            return self._experts(x, ids, weights, *self.resident[j], **self._extras[j])
        if self.streamer is None:                  # pageable host pool: all on the CPU
            return self.branch.run_all(x, ids, weights, self.host.host(j), self._cpu_extras[j])
        return self.streamer.run(j, x, ids, weights, self._experts, self._extras[j])

    def _experts(self, x, ids, weights, gate_up, down, **extras):
        """The experts op into a fresh f32[T,H] (GPU wrappers take a preallocated out)."""
        out = self.dev.xp.empty((x.shape[0], x.shape[1]), np.float32)
        return self._op(x, ids, weights, gate_up, down, out, **extras)

    def _ids_scratch(self, shape) -> tuple:
        if shape not in self._scratch:
            xp = self.dev.xp
            self._scratch[shape] = (xp.empty(shape, np.int32), xp.empty(shape, np.int32))
        return self._scratch[shape]

    def _decode_cached(self, j, x, ids, weights):
        slots, cpu_ids = self._ids_scratch(tuple(ids.shape))
        slots[...] = ids                               # the caller's ids stay as they were
        self.res.step(j, slots, cpu_ids, self.policy)
        self.dev.record(self._planned)                 # the fills wait for the step, not for staging
        job = self.branch.start(x, cpu_ids, weights, self.host.host(j), self._cpu_extras[j]) if self.branch else None
        out = None
        try:
            self._fill(j)
            out = self._experts(x, slots, weights, *self.slots(j), **self._slot_extras(j, slots, ids))
        finally:
            if job is not None:                        # never leave a CPU job in flight
                self.branch.finish(job, out)
        return out

    def _slot_extras(self, j: int, slots, ids) -> dict:
        """Layer j's op keywords for a call on the slot pool: its biases (rows by expert id) gathered
        into rows by slot, so row slots[t, i] holds expert ids[t, i]'s (slot -1, on the CPU, writes
        a spare last row). Device work only, on the compute stream (it allocates temporaries: the
        cached backends' decode is not captured in CUDA graphs)."""
        extras = self._extras[j]
        if "bias" not in extras:
            return extras
        xp, S = self.dev.xp, self.slots(j)[0].shape[0]
        rows = self._bias_rows(S, extras["bias"])
        at, src = xp.where(slots >= 0, slots, S).ravel(), xp.maximum(ids, 0).ravel()
        for dst, bias in zip(rows, extras["bias"]):
            dst[at] = bias[src]
        return {**extras, "bias": tuple(r[:S] for r in rows)}

    def _bias_rows(self, S: int, bias) -> tuple:
        key = ("bias", S) + tuple(b.shape[1] for b in bias)
        if key not in self._scratch:
            self._scratch[key] = tuple(self.dev.xp.zeros((S + 1, b.shape[1]), np.float32) for b in bias)
        return self._scratch[key]

    def _fill(self, j: int) -> None:
        """The last step's fill plan, host pool -> slots, on the copy stream after the residency
        step (`_planned`); the compute stream waits for it (`_filled`)."""
        dev = self.dev
        dev.wait(self._planned, on_copy=True)
        with dev.copy_stream():
            self.res.fill(dev.host_views(self.host, j), self.slots(j))
        dev.record(self._filled, on_copy=True)
        dev.wait(self._filled)

    def stats(self) -> dict:
        """Backend, slots, policy, per-layer and total counters (distinct experts per layer-step),
        and device facts; reads the device counters (a sync)."""
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
        self._zero_host_counters()

    def _zero_host_counters(self) -> None:
        """The counters kept on the host (the device's are in the residency state)."""
        self.prefill_calls = 0
        if self.branch is not None:
            self.branch.calls = 0

    def rebuild(self, num_slots: int) -> None:
        """New slot pool of num_slots at a safe point (no call in flight): the old pool is freed
        first (the device may not hold both), the host pool is kept; cold cache, zero counters.
        On failure the old size is allocated again and the error re-raised."""
        assert self.cached and num_slots >= 1, (self.backend, num_slots)   # the plan checked both
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
        self._zero_host_counters()

    def close(self) -> None:
        """Join the CPU worker and drop device arrays; idempotent. The host pool stays (rebuilds
        and new runtimes reuse it); HostPool.close() unpins it."""
        if self.branch is not None:
            self.branch.close()
        self.pool = self.streamer = self.resident = None

    def __enter__(self) -> "MoERuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefill_stream_slots(num_experts: int, disable_overlap: bool) -> int:
    """Slots the cpu backend borrows on a discrete device to stream prefill: one layer's experts,
    or two (the next layer loads while this one computes)."""
    return (1 if disable_overlap else 2) * num_experts


def host_pool_for(cfg: ModelConfig, banks, plan: MoEPlan, dev, log=None) -> HostPool:
    """The host expert pool the runtime reads: banks as given when already a HostPool (rebuilds
    reuse it), else pinned when the device reads host memory and the backend fetches or stages
    from it (a pinning failure is a WARN and a pageable pool: start-up then plans again), else
    pageable. banks: one (gate_up [E,2I,H], down [E,H,I]) per MoE layer, in cfg.moe_layers order."""
    host, raw = _host_banks(cfg, banks)
    if host is not None:
        return host
    pin = plan.backend != "fused" and dev.needs_pinning
    return pin_host_pool(raw, log) if pin else HostPool.pageable(raw)


def build_moe(cfg: ModelConfig, banks, plan: MoEPlan, experts_op, log=None, *, dev=None, cpu_op=None,
              handoff: str = HANDOFF_MODE, cpu_dots: str = "f32", biases=None) -> MoERuntime:
    """The runtime the plan describes (engine/plan.py decides backend, slots and fetch policy; this
    builds, it does not decide). banks: a HostPool or the raw banks (host_pool_for). experts_op: the
    device's `experts` op (contract signature). log: a Logger or a callable(msg). dev: moe/device.py
    (default HostDevice). cpu_op: the CPU experts op; default experts_op on a host-memory device (it
    runs on the CPU already, and on the ref backend stays the numpy spec), else kernels.experts.cpu
    with its quantized dots as cpu_dots says (kernels/qact.py). biases: per MoE layer (gate_up_bias
    f32[E,2I], down_bias f32[E,H]) of a model whose experts add them (gpt-oss), else None."""
    dev = dev if dev is not None else HostDevice()
    extras, cpu_extras = _op_extras(cfg, biases, plan.backend, dev)
    host = host_pool_for(cfg, banks, plan, dev, log)
    if plan.backend in CACHED and dev.needs_pinning and not host.pinned:
        raise ConfigError(f"moe {plan.backend} needs a pinned host expert pool; plan again with the pinning "
                          "failure known (engine/plan.py falls back to cpu)")
    if cpu_op is None:
        cpu_op = experts_op if dev.host_memory else _kernel_cpu_op(cpu_dots)
    where = f"moe {plan.backend} on {dev.name}" + _stored_as(host.banks)
    Log(log).info(f"{where}: {plan.slots} expert slots for {host.num_layers} layers x {cfg.num_experts} experts"
                  if plan.slots else where)
    moe = MoERuntime(plan.backend, host, dev, experts_op, cpu_op, policy=plan.policy, num_slots=plan.slots,
                     cpu_threads=plan.cpu_threads or 0, handoff=handoff, log=log,
                     disable_overlap=plan.disable_prefill_overlap, extras=extras, cpu_extras=cpu_extras)
    moe.prefill_decode_tokens = plan.prefill_decode_tokens
    return moe


def _op_extras(cfg: ModelConfig, biases, backend: str, dev) -> tuple[list[dict] | None, list[dict] | None]:
    """Per MoE layer, the experts op's keywords beyond the banks: the clamped SwiGLU's (alpha, limit)
    and the layer's expert biases, indexed by expert id (a call on the expert cache's slots gets
    them gathered by slot: MoERuntime._slot_extras). Two lists: the device op's (the biases as
    given: on the device) and the CPU branch's (on a discrete device, host copies)."""
    if cfg.expert_bias and biases is None:
        raise ValueError("build_moe: this model's experts add biases; pass biases= (one pair per MoE layer)")
    if biases is None and cfg.glu is None:
        return None, None
    glu = {} if cfg.glu is None else {"glu": cfg.glu}
    pairs = biases or [None] * len(cfg.moe_layers)
    device = [{**glu, **({} if b is None else {"bias": b})} for b in pairs]
    if dev.host_memory:
        return device, device
    return device, [{**glu, **({} if b is None else {"bias": tuple(dev.to_host(a) for a in b)})} for b in pairs]


def _stored_as(banks: list[Bank]) -> str:
    """", experts in q4_k/q6_k blocks, 1.69 MiB a slot" for quantized banks (slots, fills and kernels
    take the blocks as stored), else ""."""
    if not banks[0].quantized:
        return ""
    from freetoken.kernels.qformats import format_of
    names = sorted({format_of(a).name for b in banks for a in (b.gate_up, b.down)})
    slot = sum(quantized_slot_bytes(banks))
    return f", experts in {'/'.join(names)} blocks, {slot / 2**20:.2f} MiB a slot"


def _resident(backend: str, host: HostPool, dev) -> list[tuple] | None:
    """Per layer (gate_up, down) of every expert on the device, or None. On a host-memory device
    the host pool is device memory: every backend has every expert resident, in place (a copy
    would double the experts' memory)."""
    if dev.host_memory:
        return [host.host(j) for j in range(host.num_layers)]
    if backend == "fused":
        return [(dev.to_device(b.gate_up), dev.to_device(b.down)) for b in host.banks]
    return None


def _host_banks(cfg: ModelConfig, banks) -> tuple[HostPool | None, list[Bank]]:
    """(the HostPool if banks is one, the banks as checked Bank objects)."""
    host = banks if isinstance(banks, HostPool) else None
    raw = host.banks if host else [b if isinstance(b, Bank) else Bank(*b) for b in banks]
    check_banks([(b.gate_up, b.down) for b in raw], cfg.num_experts, cfg.hidden_size,
                cfg.moe_intermediate_size)
    if len(raw) != len(cfg.moe_layers):
        raise ConfigError(f"{len(raw)} expert banks for {len(cfg.moe_layers)} MoE layers")
    return host, raw


def _kernel_cpu_op(cpu_dots: str):
    from functools import partial

    from freetoken.kernels.experts import cpu
    return partial(cpu, dots=cpu_dots)
