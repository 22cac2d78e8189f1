"""CPU expert executor: one worker thread that runs the `experts` op on the host banks
(docs/design.md, The CPU expert executor).

The hybrid backend submits the (token, expert) pairs that did not get a slot, then computes the
resident ones itself; the worker runs at the same time because the numba kernels release the GIL
(nogil). One job is in flight at a time, as in upstream: a layer submits, works, then waits.

Shape legend: T tokens, H hidden, E experts, k routed, I expert width.
"""
from __future__ import annotations

import queue
import threading

import numpy as np

_STOP = object()


def overflow_ids(raw: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Expert ids for the CPU: raw[t, j] where the residency step rewrote slots[t, j] to -1, else -1.

    raw, slots: int32[T,k] (original ids, rewritten ids) -> int32[T,k].
    """
    return np.where(slots < 0, raw, np.int32(-1)).astype(np.int32, copy=False)


class CpuExecutor:
    """Runs experts_op(x, ids, weights, gate_up, down, out) on a worker thread.

    submit() returns at once; wait() returns the partial sum f32[T,H] or re-raises what the op
    raised. close() stops and joins the thread; the executor is also a context manager.
    """

    def __init__(self, experts_op, threads: int = 0, name: str = "freetoken-moe-cpu"):
        self._op = experts_op
        self._threads = threads
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._pending = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, x, ids, weights, gate_up, down, out=None, **extras) -> None:
        """Queue one op call: x f32[T,H], ids int32[T,k] (-1 skipped), weights f32[T,k], banks [E,...];
        extras: the op's keywords (a gpt-oss layer's bias= and glu=)."""
        if self._thread is None:
            raise RuntimeError("CpuExecutor.submit after close()")
        if self._pending:
            raise RuntimeError("CpuExecutor.submit while a job is in flight; wait() first")
        if out is None:
            out = np.empty((x.shape[0], x.shape[1]), np.float32)
        self._pending = True
        self._jobs.put(((x, ids, weights, gate_up, down, out), extras))

    def wait(self) -> np.ndarray:
        """The partial sum f32[T,H] of the job in flight; re-raises the worker's exception."""
        if not self._pending:
            raise RuntimeError("CpuExecutor.wait with no job in flight")
        ok, value = self._results.get()
        self._pending = False
        if not ok:
            raise value                           # the worker's own exception and traceback
        return value

    def run(self, x, ids, weights, gate_up, down, out=None) -> np.ndarray:
        """submit() then wait()."""
        self.submit(x, ids, weights, gate_up, down, out)
        return self.wait()

    def close(self) -> None:
        """Stop the worker and join it; idempotent. A job still in flight is finished first."""
        if self._thread is None:
            return
        self._jobs.put(_STOP)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "CpuExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _work(self) -> None:
        configured = self._threads <= 0
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                if not configured:                # inside try: a failure reaches wait()
                    self._set_numba_threads(self._threads)
                    configured = True
                args, extras = job
                self._results.put((True, self._op(*args, **extras)))
            except BaseException as err:          # handed to wait(); the worker keeps serving
                self._results.put((False, err))

    @staticmethod
    def _set_numba_threads(n: int) -> None:
        # numba's thread count is per calling thread, so it is set here, inside the worker.
        import numba
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
