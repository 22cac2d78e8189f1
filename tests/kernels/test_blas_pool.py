"""The prefill's thread pool: every item runs once, per-thread state, BLAS one-threaded during a
region and restored after, errors raised to the caller, nested regions run inline."""
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from freetoken.kernels import _blas_pool


def blas_threads():
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_every_item_once_with_thread_state():
    seen, lock = [], threading.Lock()

    def work(item, st):
        st.append(item)
        with lock:
            seen.append(item)

    states = _blas_pool.run_items(range(100), work, list)
    assert sorted(seen) == list(range(100))
    assert sorted(x for st in states for x in st) == list(range(100))
    assert 1 <= len(states) <= _blas_pool.workers()


def test_blas_is_one_thread_inside_and_restored_after():
    before = blas_threads()
    inside = []
    _blas_pool.run_items(range(8), lambda item, st: inside.append(blas_threads()))
    if _blas_pool.workers() > 1:
        assert all(t == [1] * len(before) for t in inside)
    assert blas_threads() == before


def test_an_error_in_an_item_reaches_the_caller_and_the_limit_is_lifted():
    before = blas_threads()

    def work(item, st):
        if item == 5:
            raise ValueError("item 5")

    with pytest.raises(ValueError, match="item 5"):
        _blas_pool.run_items(range(40), work)
    assert blas_threads() == before
    assert _blas_pool.run_items(range(3), lambda i, st: None)      # the pool still works


@pytest.mark.parametrize("threads", [1, 2])
def test_nested_region_runs_inline(threads, monkeypatch):
    monkeypatch.setattr(_blas_pool, "workers", lambda: threads)       # 1: the outer one is inline too
    inner = []

    def outer(item, st):
        inner.append(len(_blas_pool.run_items(range(4), lambda i, s: None, lambda: item)))

    _blas_pool.run_items(range(4), outer)
    assert inner == [1, 1, 1, 1]


def test_results_match_a_plain_matmul():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 96)).astype(np.float32)
    b = rng.standard_normal((96, 200)).astype(np.float32)
    out = np.empty((64, 200), np.float32)

    def block(m0, st):
        np.matmul(a, b[:, m0:m0 + 16], out=out[:, m0:m0 + 16])

    _blas_pool.run_items(range(0, 200, 16), block)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_one_worker_runs_inline_with_blas_one_threaded_too(monkeypatch):
    before = blas_threads()
    monkeypatch.setattr(_blas_pool, "workers", lambda: 1)
    seen = []
    states = _blas_pool.run_items(range(5), lambda i, st: seen.append((threading.get_ident(),
                                                                        blas_threads())))
    assert len(states) == 1 and {t for t, _ in seen} == {threading.get_ident()}
    assert all(b == [1] * len(before) for _, b in seen) and blas_threads() == before
