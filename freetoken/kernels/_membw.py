"""Memory read bandwidth of this machine, the yardstick for bandwidth-bound kernels; used by
bench/kernels/experts_cpu.py and the other CPU benchmarks."""
import time

import numpy as np

from freetoken.kernels._numba import HOT, SERIAL, load_numba, njit, prange

CHUNKS = 256  # parallel work items; many more than threads so a slow core does not dominate


@njit(**SERIAL)
def _sum(a):
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i]
    return acc


@njit(**HOT)
def _parallel_sum(a, part):
    """part[c] = sum of chunk c of a f32[n]: each work item streams one contiguous chunk (an
    inner function, because numba vectorises a plain loop but not one written in a prange body)."""
    n = a.shape[0]
    step = (n + CHUNKS - 1) // CHUNKS
    for c in prange(CHUNKS):
        part[c] = _sum(a[c * step:min(n, (c + 1) * step)])


def measure_read_bandwidth(threads=None, nbytes=1 << 30, repeats=5) -> float:
    """Best-of-``repeats`` GB/s (1e9 bytes/s) of a numba parallel sum over ``nbytes`` of
    float32, run on ``threads`` numba threads (default: numba's current setting)."""
    numba = load_numba()
    a = np.ones(nbytes // 4, np.float32)  # written once so every page is really mapped
    part = np.empty(CHUNKS, np.float32)
    saved = numba.get_num_threads()
    if threads:
        numba.set_num_threads(int(threads))
    try:
        _parallel_sum(a[:1024], part)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            _parallel_sum(a, part)
            best = min(best, time.perf_counter() - t0)
    finally:
        numba.set_num_threads(saved)
    return a.nbytes / best / 1e9
