"""One timed child process for the benchmarks that compare whole programs (bench/compare_llamacpp.py):
wall time, time to its first stdout byte, and its own peak RSS (from wait4, so no /usr/bin/time and
no other child's peak mixed in, as RUSAGE_CHILDREN would); and the environment it runs in."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class ChildRun:
    cmd: list
    returncode: int
    wall_s: float                 # process start to exit
    first_byte_s: float | None    # process start to the first byte on stdout (None: it wrote none)
    max_rss_bytes: int            # the child's peak resident set (ru_maxrss)
    stdout: str
    stderr: str
    timed_out: bool = False

    def check(self, what: str) -> "ChildRun":
        """self, or RuntimeError with the command's stderr tail when it failed."""
        if self.returncode != 0:
            tail = "\n".join(self.stderr.strip().splitlines()[-15:])
            why = "timed out" if self.timed_out else f"exited with {self.returncode}"
            raise RuntimeError(f"{what} {why}: {' '.join(map(str, self.cmd))[:300]}\n{tail}")
        return self


def run_child(cmd, env=None, timeout: float | None = None, cwd=None) -> ChildRun:
    """Run cmd to completion; stdout is read as it comes so the first byte is timed when written."""
    cmd = [str(c) for c in cmd]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                         start_new_session=True)      # a timeout kills the whole group
    first, out, err = [], [], []

    def read_stdout():
        while chunk := p.stdout.read1(1 << 16):
            if not first:
                first.append(time.perf_counter())
            out.append(chunk)

    readers = [threading.Thread(target=read_stdout, daemon=True),
               threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)]
    for r in readers:
        r.start()
    killed = []
    timer = threading.Timer(timeout, lambda: (killed.append(1), os.killpg(p.pid, signal.SIGKILL))) \
        if timeout else None
    if timer:
        timer.start()
    _, status, usage = os.wait4(p.pid, 0)     # reaps it: Popen.wait would lose the rusage
    wall = time.perf_counter() - t0
    if timer:
        timer.cancel()
    for r in readers:
        r.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(cmd, p.returncode, wall, first[0] - t0 if first else None,
                    usage.ru_maxrss * 1024,           # Linux reports KiB
                    b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"),
                    bool(killed))


def child_env(threads: int) -> dict:
    """This environment with every thread pool a child may start (numba/OpenMP, BLAS) at `threads`."""
    keys = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    return {**os.environ, **{k: str(threads) for k in keys}}


def run_env(env: dict) -> dict:
    """The variables of a child's environment that change what it runs (threads, BLAS kernels)."""
    prefixes = ("OPENBLAS", "OMP_", "NUMBA_", "MKL_", "FREETOKEN_", "GGML_", "LLAMA_")
    return {k: v for k, v in env.items() if k.startswith(prefixes)}


def read_through(paths) -> int:
    """Read files once so that the next run finds them in the page cache (this box's proactive
    reclaim, kdamond, evicts a model's pages between runs); returns the bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


@contextmanager
def busy_core():
    """Another tenant of a shared box for the duration: one process spinning on a core."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.3)                        # it is running before the measured run starts
        yield hog
    finally:
        hog.kill()
        hog.wait()
