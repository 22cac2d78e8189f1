"""Progress of the numba compiles a warm-up triggers: what is compiling, how many are done.

The first start on a machine (or after an upgrade, or on another CPU: numba keys its cache by the
CPU name and features) compiles every CPU kernel, about a minute on two cores; later starts load
them from the cache in well under a second. numba reports each real compile as a
"numba:compile" event (a cache load raises none), so counting those events costs the kernels
nothing. The total drawn is how many compiles the last cold warm-up of the same model kind made
(every kernel compiled, none loaded: a small JSON file in FREETOKEN_HOME), else the packaged
estimate below. A compile of one kernel compiles the helpers it inlines too, each an event.

Output: on a terminal, a bar redrawn on stderr; in logs, one line when compiling starts, one
every LOG_EVERY_S seconds, one at the end with the count, the time and where the cache lives.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager

from freetoken.env import home
from freetoken.progress import draw_line, end_line, is_tty

LOG_EVERY_S = 15.0
# compiles of one cold warm-up by model kind: the bf16 ones measured on numba 0.68 (tiny-agent-moe,
# synth:tiny-hybrid), f32 taken to be the same; a count off by some only moves the bar's end, and
# the first warm-up that compiles everything records the true one
ESTIMATES = {"moe/bf16": 97, "moe/f32": 97, "gdn/bf16": 153, "gdn/f32": 153}


def counts_path():
    return home() / "compile_counts.json"


def expected(kind: str) -> int:
    try:
        return int(json.loads(counts_path().read_text())[kind])
    except (OSError, ValueError, KeyError, TypeError):
        return ESTIMATES.get(kind, 0)


def remember(kind: str, compiles: int) -> None:
    """Record how many compiles a cold warm-up of this kind made (best effort: home may be
    read-only)."""
    try:
        path = counts_path()
        data = json.loads(path.read_text()) if path.exists() else {}
        data[kind] = compiles
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
    except (OSError, ValueError):
        pass


class CompileProgress:
    """Counts numba compiles (any thread) and reports them; see the module doc."""

    def __init__(self, log, total: int):
        self.log, self.total = log, total
        self.done, self.current, self.t0, self.last_log = 0, "", None, 0.0
        self.dispatchers: set[int] = set()         # ids of the dispatchers that compiled
        self.tty = is_tty(sys.stderr)
        self._lock = threading.Lock()

    def started(self, name: str, dispatcher) -> None:
        with self._lock:
            self.dispatchers.add(id(dispatcher))
            now = time.monotonic()
            if self.t0 is None:
                self.t0 = self.last_log = now
                self.log.info("compiling the CPU kernels (first start on this CPU or after an upgrade; "
                              "tens of seconds on 2 cores, cached in %s for later starts)", cache_dir())
            self.current = name
            self._report(now)

    def finished(self) -> None:
        with self._lock:
            self.done += 1
            self._report(time.monotonic())

    def _report(self, now: float) -> None:
        total = max(self.total, self.done)
        if self.tty:
            draw_line(sys.stderr, "compiling kernels", self.done, total, now - self.t0, self.current)
        elif now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            self.log.info("compiling kernels: %d of ~%d done, now %s (%.0f s)", self.done, total,
                          self.current, now - self.t0)

    def close(self) -> None:
        if self.t0 is None:
            return
        if self.tty:
            end_line(sys.stderr)
        self.log.info("compiled %d kernels in %.1f s", self.done, time.monotonic() - self.t0)


def cache_dir() -> str:
    return os.environ.get("NUMBA_CACHE_DIR") or "the package's __pycache__ directories"


@contextmanager
def watch_compiles(log, kind: str):
    """Report every numba compile inside the block; when the block compiled every kernel it used
    (none came from the cache), record the count as the next cold start's total."""
    from freetoken.kernels._numba import in_use, load_numba
    numba = load_numba()
    progress = CompileProgress(log, expected(kind))
    before = {id(d) for d in in_use()}       # e.g. a synthetic model's weight fill ran already

    class Listener(numba.core.event.Listener):
        def on_start(self, event):
            dispatcher = event.data["dispatcher"]
            func = getattr(dispatcher, "py_func", None)
            progress.started(getattr(func, "__qualname__", "?").rsplit(".v", 1)[0], dispatcher)

        def on_end(self, event):
            progress.finished()

    try:
        with numba.core.event.install_listener("numba:compile", Listener()):
            yield progress
    finally:
        progress.close()
    new = [d for d in in_use() if id(d) not in before]
    if new and all(id(d) in progress.dispatchers for d in new):
        remember(kind, progress.done)
