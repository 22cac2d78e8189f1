"""The CPU prefill's thread pool: BLAS work split into independent items, one Python thread per
core taking items in order, BLAS single-threaded for the duration.

Why not BLAS's own threads. OpenBLAS's worker threads keep spinning for a while after each call
(`OPENBLAS_THREAD_TIMEOUT`, 2^28 cycles by default), so the numba kernels that follow a GEMM found
the other core taken: on medium a 512-token prefill's rope took 128 ms instead of 22, kv_write 83
instead of 1.5, attention 625 instead of 408 (2-core Xeon). And the GEMMs of a prefill are many and
small (one per routed expert, 64 tokens each at 512): each split over two BLAS threads pays a sync
per call and still widens its bf16 weights on one thread. One expert per thread, start to end, has
neither cost: 164 -> 117 ms a layer of experts at 512 tokens, 640 -> 520 at 4,000 (medium's
shape; in the engine: `bench/decode_cpu.py --profile --prompt 512`, its prefill profile). While
the pool runs, numba's threads are idle (no kernel is in flight): the cores are not oversubscribed.

`threadpoolctl` sets the BLAS thread count: it knows OpenBLAS, MKL and BLIS under whatever names
numpy's wheel gives them; a BLAS it cannot set (Accelerate) stays multi-threaded, which is slower
but still correct.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable

_lock = threading.Lock()        # one parallel region at a time: the BLAS limit is process-wide
_pool: ThreadPoolExecutor | None = None
_controller = None
_local = threading.local()      # .inside: this thread is one of the pool's workers


def workers() -> int:
    """Threads a region uses: numba's count for the calling thread (the engine's `--threads`,
    the MoE executor's own count on the GPU path), so both kinds of kernel use the same cores."""
    from freetoken.kernels._numba import load_numba
    return max(1, load_numba().get_num_threads())


def _blas():
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController
        _controller = ThreadpoolController()
    return _controller


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < n:
        old, _pool = _pool, ThreadPoolExecutor(n, thread_name_prefix="freetoken-blas")
        if old is not None:
            old.shutdown(wait=False)
    return _pool


def run_items(items: Iterable, work: Callable, state: Callable = lambda: None) -> list:
    """work(item, st) for every item, by up to workers() threads, each taking the next item when
    it is free (put the biggest first); st = state() once per thread. Returns the states of the
    threads that ran. An exception in any item is raised here after the others stop."""
    todo = list(items)
    n = min(workers(), len(todo))
    if getattr(_local, "inside", False):          # nested: this thread is a worker already
        return [_inline(todo, work, state)]
    if n <= 1:                                     # one thread (--threads 1, the tuner): no spinning BLAS
        with _lock, _blas().limit(limits=1, user_api="blas"):
            _local.inside = True                   # a nested region must not take _lock again
            try:
                return [_inline(todo, work, state)]
            finally:
                _local.inside = False
    feed, failed = iter(todo), threading.Event()
    take = threading.Lock()

    def drain():
        _local.inside = True
        st = state()
        try:
            while not failed.is_set():
                with take:
                    item = next(feed, _DONE)
                if item is _DONE:
                    return st
                work(item, st)
        except BaseException:
            failed.set()
            raise
        finally:
            _local.inside = False
        return st

    with _lock, _blas().limit(limits=1, user_api="blas"):
        futures = [_executor(n).submit(drain) for _ in range(n)]
        wait(futures)                     # all stopped before the BLAS limit is lifted
        return [f.result() for f in futures]


_DONE = object()


def _inline(todo: list, work: Callable, state: Callable):
    st = state()
    for item in todo:
        work(item, st)
    return st


def _forget_after_fork():
    """A forked child has none of the parent's pool threads: make it start its own."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
