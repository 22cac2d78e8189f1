"""The CPU branch of a MoE layer call (docs/design.md, The q* split; The CPU expert executor):
the (token, expert) pairs the residency step left at -1 run on the CPU from the host pool while
the device runs the rest. The
runtime calls ``start`` after the residency step, ``finish`` after the device's experts op, and
``run_all`` for the cpu backend; `make_cpu_branch` picks one of two implementations by the
device's one capability (device.host_memory).

``CpuBranch`` (a discrete device). Per call, on the compute stream: x, the CPU ids and the weights
are copied to pinned staging buffers and an event is recorded (``start``/``stage``). The host
waits for that event only after it has enqueued the GPU's own work, so the GPU computes its hits
and fills meanwhile; the CPU op then runs (on the executor's worker thread, or inline on the
caller's thread), and its partial sum is copied back and added to the GPU's output on the compute
stream (``finish``). A call whose pairs all got a slot costs the copy and the event wait, no
hand-off and no merge.

Staging buffers are shared by all layers (one set per token count): safe because layer l's merge
copy is enqueued before layer l+1's staging copy, whose event the host waits for before the CPU
writes the buffers again (docs/design.md, Hazards: shared staging buffers follow stream order).

``HostCpuBranch`` (a host-memory device): x, the ids and the weights are host arrays already and
the device op before ``start`` is done, so there is nothing to stage or copy back, and the job can
go to the executor thread at once: it then overlaps the fills and the slot-pool op that follow.
``run_all`` has nothing to overlap with, so it calls the kernel inline on the caller's thread: a
hand-off to the executor thread measured 5-9% (1 thread) to 8-22% (2 threads) slower than fused
on the 2-core VM (docs/performance.md).

Shape legend: T tokens, H hidden, k routed.
"""
from __future__ import annotations

import time

import numpy as np

from freetoken.moe.executor import CpuExecutor

HANDOFF_MODES = ("thread", "inline")
# "thread" (the executor's worker: docs/design.md, The CPU expert executor) is the default;
# "inline" runs the op on the calling thread, which overlaps the GPU just as well (its work is
# already enqueued) without the queue hand-off. `measure_handoff` times both; switch the default
# only on a measurement.
HANDOFF_MODE = "thread"


class CpuBranch:
    """Stages, runs and merges the CPU share of MoE layer calls; `dev` is a device (moe/device.py)."""

    def __init__(self, dev, cpu_op, threads: int = 0, mode: str = HANDOFF_MODE):
        if mode not in HANDOFF_MODES:
            raise ValueError(f"CPU hand-off mode {mode!r}; expected one of {HANDOFF_MODES}")
        self.dev, self._op, self.mode = dev, cpu_op, mode
        self.executor = CpuExecutor(cpu_op, threads) if mode == "thread" else None
        self._staged, self._grown = dev.event(), dev.event()
        self._bufs: dict[tuple, tuple] = {}     # (H, k) -> (rows, buffers)
        self.calls = 0                   # layer calls that had CPU work (after the early exit)

    def _buffers(self, T: int, H: int, k: int) -> tuple:
        """The first T rows of x_h, ids_h, w_h, out_h (pinned) and the device partial. Grown to the
        next power of two, so prefill chunks of every length do not each pin a new set."""
        cap, bufs = self._bufs.get((H, k), (0, None))
        if cap < T:
            if bufs is not None:         # a copy from the old set may be in flight: let it land
                self.dev.record(self._grown)
                self.dev.synchronize(self._grown)
            cap, d = 1 << (T - 1).bit_length(), self.dev
            bufs = (d.pinned((cap, H), np.float32), d.pinned((cap, k), np.int32),
                    d.pinned((cap, k), np.float32), d.pinned((cap, H), np.float32),
                    d.xp.empty((cap, H), np.float32))
            self._bufs[(H, k)] = (cap, bufs)
        return tuple(b[:T] for b in bufs)

    def start(self, x, cpu_ids, weights, bank, extras=None) -> tuple:
        """Stage the call's inputs (see stage); bank (gate_up, down) is the layer's host bank,
        extras the op's keywords for it (host arrays)."""
        return self.stage(x, cpu_ids, weights), bank, extras

    def stage(self, x, cpu_ids, weights) -> tuple:
        """Enqueue x f32[T,H], cpu_ids int32[T,k] (-1: not on the CPU), weights f32[T,k] -> pinned."""
        bufs = self._buffers(x.shape[0], x.shape[1], cpu_ids.shape[1])
        for dst, src in zip(bufs[:3], (x, cpu_ids, weights)):
            self.dev.d2h(dst, self.dev.xp.ascontiguousarray(src))
        self.dev.record(self._staged)
        return bufs

    def finish(self, job: tuple, out) -> bool:
        """Wait for the staging copy, run the CPU pairs of start's job, add into out f32[T,H] on
        the compute stream. False (nothing done) when no pair is on the CPU, or when out is None
        (the device op raised: the staging copy is only waited for)."""
        bufs, bank, extras = job
        self.dev.synchronize(self._staged)
        if out is None or not (bufs[1] >= 0).any():
            return False
        self.compute(bufs, bank, extras)
        self.merge(bufs, out)
        return True

    def run_all(self, x, ids, weights, bank, extras=None):
        """Every pair on the CPU (the cpu backend): f32[T,H] on the device. extras: the op's bias /
        glu keywords, host arrays (moe/runtime.py's cpu_extras), run inline with them."""
        bufs = self.stage(x, ids, weights)
        self.dev.synchronize(self._staged)
        self.compute(bufs, bank, extras)
        out = self.dev.xp.empty(x.shape, np.float32)
        self.dev.h2d(out, bufs[3])
        return out

    def compute(self, bufs: tuple, bank, extras=None) -> None:
        x_h, ids_h, w_h, out_h, _ = bufs
        self.calls += 1
        if self.executor is None:
            self._op(x_h, ids_h, w_h, bank[0], bank[1], out_h, **(extras or {}))
            return
        self.executor.submit(x_h, ids_h, w_h, bank[0], bank[1], out_h, **(extras or {}))
        self.executor.wait()

    def merge(self, bufs: tuple, out) -> None:
        partial = bufs[4]
        self.dev.h2d(partial, bufs[3])
        out += partial

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


class HostCpuBranch:
    """The CPU branch on a host-memory device: in place, no staging, no merge copy. overlap (hybrid)
    gives it the executor thread; without it (the cpu backend) there is none."""

    def __init__(self, cpu_op, threads: int = 0, overlap: bool = True):
        self._op = cpu_op
        self.executor = CpuExecutor(cpu_op, threads) if overlap else None
        self.calls = 0                   # layer calls that had CPU work

    def start(self, x, cpu_ids, weights, bank, extras=None):
        """Submit the -1 pairs (cpu_ids int32[T,k], -1: not on the CPU) to the executor thread;
        None when there are none. The arrays must stay as they are until finish()."""
        if not (cpu_ids >= 0).any():
            return None
        self.calls += 1
        self.executor.submit(x, cpu_ids, weights, bank[0], bank[1], **(extras or {}))
        return True

    def finish(self, job, out) -> None:
        """Wait for the job and add its partial sum into out (None: the device op raised; only
        wait, so that no job is left in flight)."""
        partial = self.executor.wait()
        if out is not None:
            out += partial

    def run_all(self, x, ids, weights, bank, extras=None):
        """Every pair on the CPU (the cpu backend), inline: f32[T,H]. extras: the op's bias / glu."""
        self.calls += 1
        out = np.empty((x.shape[0], x.shape[1]), np.float32)
        return self._op(x, ids, weights, bank[0], bank[1], out, **(extras or {}))

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


def make_cpu_branch(dev, cpu_op, threads: int = 0, mode: str = HANDOFF_MODE, overlap: bool = True):
    """The CPU branch for dev: in place on a host-memory device (mode does not apply there: it runs
    on the executor thread when overlap, inline otherwise), staged through pinned buffers else."""
    if dev.host_memory:
        return HostCpuBranch(cpu_op, threads, overlap)
    return CpuBranch(dev, cpu_op, threads, mode)


def _zero_work(x, ids, weights, gate_up, down, out=None):
    out[...] = 0.0                       # T*H floats: noise next to the hand-off being timed
    return out


def measure_handoff(dev=None, tokens: int = 1, hidden: int = 2048, top_k: int = 8,
                    iters: int = 200, modes=HANDOFF_MODES) -> dict:
    """Per-layer cost of the CPU branch's hand-off with a zero-work experts op, in microseconds
    (medians): stage (D2H + event wait), handoff (submit + wait, or the inline call), merge (H2D +
    add, until done), total. `dev` defaults to the GPU when there is one, else the host."""
    if dev is None:
        dev = _default_device()
    xp, result = dev.xp, {"device": dev.name, "tokens": tokens, "hidden": hidden, "top_k": top_k}
    x = xp.zeros((tokens, hidden), np.float32)
    ids = xp.zeros((tokens, top_k), np.int32)          # every pair on the CPU: never the early exit
    w = xp.ones((tokens, top_k), np.float32)
    out = xp.zeros((tokens, hidden), np.float32)
    bank = (np.zeros((1, 2, hidden), np.uint16), np.zeros((1, hidden, 1), np.uint16))
    done = dev.event()
    for mode in modes:
        branch = CpuBranch(dev, _zero_work, mode=mode)
        try:
            samples = [_time_once(branch, dev, done, x, ids, w, bank, out) for _ in range(iters + 10)]
        finally:
            branch.close()
        med = np.median(np.asarray(samples[10:]), axis=0) * 1e6
        result[mode] = {k: round(float(v), 1) for k, v in zip(("stage_us", "handoff_us", "merge_us"), med)}
        result[mode]["total_us"] = round(float(med.sum()), 1)
    return result


def _time_once(branch, dev, done, x, ids, w, bank, out) -> tuple:
    t0 = time.perf_counter()
    bufs = branch.stage(x, ids, w)
    dev.synchronize(branch._staged)
    t1 = time.perf_counter()
    branch.compute(bufs, bank)
    t2 = time.perf_counter()
    branch.merge(bufs, out)
    dev.record(done)
    dev.synchronize(done)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _default_device():
    from freetoken.backend import cuda_unavailable_reason
    from freetoken.moe.device import CudaDevice, HostDevice
    return HostDevice() if cuda_unavailable_reason() else CudaDevice()
