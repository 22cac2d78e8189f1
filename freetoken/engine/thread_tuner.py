"""Compute threads on a shared box (CPU backend): fewer when fewer decode faster.

Why: a numba parallel region ends when its slowest thread does. With another process busy on one
of the two cores, the engine's second thread gets a slice of a shared core and every one of a
decode step's ~100 regions waits for it: synth:medium decoded at 1-10 tok/s with 2 threads under
one such process, and 20-28 tok/s with 1 (2-core Xeon, docs/performance.md). So when decode steps
get SLOWDOWN x slower than they were, the tuner tries one thread fewer and keeps whichever count
was faster; while below the full count it tries the full count again every RETRY_EVERY steps (the
other process may have stopped). A process that starts on a busy box sees no slowdown (and no
jitter to go by: each step averages ~100 waits), so after its first START_STEPS steps it asks the
kernel how busy its cores were (``CoreLoad``: /proc/stat's ticks on this process's CPUs, a VM's
steal included, less the process's own CPU time) over at least START_SAMPLE_S: below IDLE_CORES of
a core taken by others there is nothing to try (a DEBUG line); otherwise, or where /proc/stat cannot
be read, one try, whatever the steps showed. The unconditional try cost every process three steps at
one thread (+60% each: ~3% of a 64-token decode of medium on the Zen 4 VM). A slowdown is needed
for any later try. The first WARM_STEPS decode steps are not timed: they pay one-time costs
(first touches of the weights, kernels compiled at first use) that made the start's try report
factors up to 600x.

A try is interleaved: its steps alternate between the tried count and the current one, and the
two medians are compared. Judging the tried steps against the slow steps that started the try
kept one thread on a shared VM whose every core slowed for a few steps (another guest's load, not
a process of this one): the tried steps ran after the slowdown ended and beat the slow ones, and
the engine then decoded 1.6x slower for RETRY_EVERY steps (EPYC Zen 4 VM, 2026-12-04). Alternate
steps see the same box. Every change is one INFO line with both speeds; a try that changes nothing
is a DEBUG line.
"""
from __future__ import annotations

import os
import time
from collections import deque
from statistics import median

WARM_STEPS = 4         # decode steps after start that are not timed (one-time costs)
PROBE_STEPS = 6        # decode steps timed per count in a try (medians: one preempted step must not decide)
START_STEPS = 3        # the first window and the try after it: short, they run on every start
SLOWDOWN = 1.5         # recent median step time over the settled one that starts a try
MARGIN = 1.1           # a try must be this much faster to be kept
RETRY_EVERY = 256      # decode steps between tries of the full count while below it
START_SAMPLE_S = 0.3   # the start's look at the cores spans at least this (/proc/stat counts 10 ms ticks)
IDLE_CORES = 0.25      # others' use of this process's cores (in cores) below which the start's try is skipped


class CoreLoad:
    """How busy other processes keep this process's CPUs: ``start()``, then ``others()`` ->
    (cores' worth of their CPU time since, averaged; None where /proc/stat is unreadable, seconds
    since). Busy ticks of the CPUs in this process's affinity, steal included (a VM neighbour takes
    the vCPU), less this process's own CPU time."""

    def __init__(self):
        self._at = None

    def start(self) -> None:
        self._at = (time.monotonic(), time.process_time(), self._busy())

    def others(self) -> tuple[float | None, float]:
        wall0, own0, busy0 = self._at
        span, busy = time.monotonic() - wall0, self._busy()
        if busy is None or busy0 is None or span <= 0:
            return None, span
        others = (busy - busy0) - (time.process_time() - own0)
        return max(0.0, others) / span, span

    @staticmethod
    def _busy() -> float | None:
        """Seconds the affinity CPUs spent neither idle nor in iowait since boot, or None."""
        try:
            cpus, tick = os.sched_getaffinity(0), os.sysconf("SC_CLK_TCK")
            with open("/proc/stat") as f:
                rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        except (OSError, AttributeError, ValueError):
            return None
        ticks = sum(sum(map(int, r[1:])) - int(r[4]) - int(r[5]) for r in rows if int(r[0][3:]) in cpus)
        return ticks / tick if rows else None


class ThreadTuner:
    """observe(seconds, tokens) after each decode-only step; set_threads(n) is called to change
    the count of the thread that runs the steps."""

    def __init__(self, full: int, set_threads, log, load=None):
        """load: a CoreLoad (a stand-in in tests)."""
        self.full = self.n = max(1, full)
        self._set, self._log, self._load = set_threads, log, load or CoreLoad()
        self._load.start()                       # again after the untimed steps
        self._recent: deque = deque(maxlen=PROBE_STEPS)
        self._batch = 0                          # tokens per step of the steps in _recent
        self._settled: dict[int, float] = {}     # median s/token at self.n, by tokens per step
        self._trial: dict | None = None          # a try: threads tried, steps a side, the count
                                                 # running, s/token by count
        self._since = 0                          # steps since the last decision
        self._tried_at_start = self.n == 1       # one try after the first window, whatever it showed
        self._warm = WARM_STEPS

    def restore(self) -> None:
        """Set the full count again (the engine is closing: the thread stays its caller's)."""
        self._trial = None
        self.n = self.full
        self._set(self.full)

    @property
    def trying(self) -> bool:
        """A try is under way (the count alternates between the tried one and self.n)."""
        return self._trial is not None

    def observe(self, seconds: float, tokens: int) -> None:
        """One decode step: its time and its tokens (a step of 4 sequences costs less per token
        than one of 1, so steps are compared only with steps of the same size)."""
        if self._warm > 0:
            self._warm -= 1
            if self._warm == 0 and not self._tried_at_start:
                self._load.start()
            return
        per_token = seconds / max(1, tokens)
        if tokens != self._batch:
            self._batch = tokens
            self._recent.clear()
            if self._trial is not None:          # a try is judged on steps of one size only
                self._set(self.n)
                self._trial = None
        if self._trial is not None:
            self._trial_step(per_token)
            return
        self._recent.append(per_token)
        self._since += 1
        if len(self._recent) < (PROBE_STEPS if self._tried_at_start else START_STEPS):
            return
        now, settled = median(self._recent), self._settled.get(tokens)
        if settled is None:
            self._settled[tokens] = now
        if not self._tried_at_start:               # started on a busy box? the steps cannot tell
            self._start_try()
        elif settled is None:
            return
        elif self.n > 1 and now > SLOWDOWN * settled:
            self._try(self.n - 1)
        elif self.n < self.full and self._since >= RETRY_EVERY:
            self._try(self.full)

    def _start_try(self) -> None:
        """One try unless the cores were idle but for this process (once START_SAMPLE_S has
        passed: until then each step asks again)."""
        others, span = self._load.others()
        if others is not None and span < START_SAMPLE_S:
            return
        self._tried_at_start = True
        if others is not None and others < IDLE_CORES:
            self._log.debug("cpu threads: other processes used %.2f of a core over the first %.2f s of "
                            "decode: no start try", others, span)
            return
        self._try(self.n - 1, START_STEPS)

    def _try(self, threads: int, steps: int = PROBE_STEPS) -> None:
        """Start a try: `steps` steps at `threads`, as many at self.n, alternating, tried first."""
        self._trial = {"threads": threads, "steps": steps, "running": threads,
                       "times": {threads: [], self.n: []}}
        self._set(threads)

    def _trial_step(self, per_token: float) -> None:
        trial = self._trial
        times = trial["times"]
        times[trial["running"]].append(per_token)
        if min(len(t) for t in times.values()) >= trial["steps"]:
            self._decide(median(times[trial["threads"]]), median(times[self.n]))
            return
        other = self.n if trial["running"] == trial["threads"] else trial["threads"]
        if len(times[other]) < trial["steps"]:
            trial["running"] = other
            self._set(other)

    def _decide(self, tried: float, kept: float) -> None:
        threads = self._trial["threads"]
        if tried * MARGIN < kept:
            why = ("another process is using this machine's cores; the full count is retried every "
                   f"{RETRY_EVERY} steps" if threads < self.n else "the cores are free again")
            self._log.info("cpu threads %d -> %d: decode %.2f -> %.2f ms a token, %.1fx faster (%s)",
                           self.n, threads, kept * 1e3, tried * 1e3, kept / tried, why)
            self.n = threads
            self._settled = {self._batch: tried}    # other sizes: measured anew
        else:
            self._log.debug("cpu threads: %d tried, %d kept (%.2f against %.2f ms a token, "
                            "alternate steps)", threads, self.n, tried * 1e3, kept * 1e3)
            self._settled[self._batch] = kept       # the box's speed now, measured at self.n
        self._set(self.n)
        self._trial, self._since = None, 0
        self._recent.clear()
