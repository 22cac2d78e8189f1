"""CpuExecutor: same result as a direct call, exceptions reach wait(), no thread left behind."""
import threading

import numpy as np
import pytest
from moe_helpers import np_experts, random_banks, random_routing

from freetoken.moe.executor import CpuExecutor, overflow_ids


def _problem(rng, T=3, E=6, H=16, I=8, k=2):
    gate_up, down = random_banks(rng, 1, E, H, I)[0]
    ids, w = random_routing(rng, T, E, k)
    return rng.standard_normal((T, H), np.float32), ids, w, gate_up, down


def test_matches_direct_call_over_many_jobs(rng):
    with CpuExecutor(np_experts) as ex:
        for _ in range(20):
            x, ids, w, gu, dn = _problem(rng)
            ids[rng.random(ids.shape) < 0.3] = -1
            ex.submit(x, ids, w, gu, dn)
            np.testing.assert_array_equal(ex.wait(), np_experts(x, ids, w, gu, dn))


def test_runs_concurrently_with_the_caller(rng):
    """The worker is a real thread: it can block on an event that the caller sets later."""
    gate = threading.Event()

    def slow_op(x, ids, w, gu, dn, out):
        assert gate.wait(5.0), "caller never ran while the job was in flight"
        return np_experts(x, ids, w, gu, dn, out)

    with CpuExecutor(slow_op) as ex:
        job = _problem(rng)
        ex.submit(*job)
        gate.set()
        np.testing.assert_array_equal(ex.wait(), np_experts(*job))


def test_worker_exception_propagates_and_worker_survives(rng):
    def failing(*args):
        raise ValueError("bad expert bank")

    with CpuExecutor(failing) as ex:
        for _ in range(2):
            ex.submit(*_problem(rng))
            with pytest.raises(ValueError, match="bad expert bank"):
                ex.wait()


def test_misuse_is_an_error(rng):
    ex = CpuExecutor(np_experts)
    with pytest.raises(RuntimeError, match="no job"):
        ex.wait()
    ex.submit(*_problem(rng))
    with pytest.raises(RuntimeError, match="in flight"):
        ex.submit(*_problem(rng))
    ex.wait()
    ex.close()
    ex.close()                                          # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        ex.submit(*_problem(rng))


def test_no_thread_leak(rng):
    before = set(threading.enumerate())
    for _ in range(5):
        with CpuExecutor(np_experts, name="leak-check") as ex:
            ex.run(*_problem(rng))
    assert set(threading.enumerate()) == before


def test_overflow_ids():
    raw = np.array([[3, 1], [1, 4]], np.int32)
    slots = np.array([[-1, 0], [0, -1]], np.int32)
    got = overflow_ids(raw, slots)
    assert got.dtype == np.int32 and got.tolist() == [[3, -1], [-1, 4]]


def test_numba_kernel_on_worker_and_caller_at_once(rng):
    """The real cpu kernel runs on the worker while the caller runs it too (nogil + threading layer)."""
    from freetoken.kernels import experts
    x, ids, w, gu, dn = _problem(rng, T=2, E=8, H=64, I=32, k=4)
    want = np_experts(x, ids, w, gu, dn)
    with CpuExecutor(experts.cpu, threads=1) as ex:
        for _ in range(10):
            ex.submit(x, ids, w, gu, dn)
            mine = experts.cpu(x, ids, w, gu, dn)
            np.testing.assert_allclose(ex.wait(), want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
