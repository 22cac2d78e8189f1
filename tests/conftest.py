"""Markers: ``gpu`` (skipped without a CUDA device; FREETOKEN_CUDA_EMULATE=1 provides an emulated
one), ``slow`` (skipped unless --slow) and ``heavy`` (a gpu test skipped on the emulated device
unless --slow: too slow there, cheap on a GPU). ``--slice i/n`` keeps the tests whose id hashes
to i of n (how .ci/run rotates race mode over the gpu tests)."""
import logging
import os
import zlib

import pytest

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run tests marked slow")
    parser.addoption("--slice", default="", help="i/n: only the tests whose id hashes to i mod n")


def _gpu_reason():
    from freetoken.backend import cuda_unavailable_reason
    return cuda_unavailable_reason()


def _keep_slice(config, items) -> None:
    if not config.getoption("--slice"):
        return
    i, n = (int(v) for v in config.getoption("--slice").split("/"))
    keep = [zlib.crc32(it.nodeid.encode()) % n == i for it in items]
    config.hook.pytest_deselected(items=[it for it, k in zip(items, keep) if not k])
    items[:] = [it for it, k in zip(items, keep) if k]


def pytest_collection_modifyitems(config, items):
    from freetoken.cupy_loader import emulated
    _keep_slice(config, items)
    gpu_reason, slow = None, config.getoption("--slow")
    for item in items:
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --slow"))
        if "heavy" in item.keywords and emulated() and not slow:
            item.add_marker(pytest.mark.skip(reason="heavy for the emulated device: runs on a real "
                                             "GPU, emulated with --slow"))
        if "gpu" in item.keywords:
            gpu_reason = gpu_reason or _gpu_reason() or ""
            if gpu_reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu: {gpu_reason}"))


@pytest.fixture
def rng():
    import numpy as np
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _freetoken_logger_as_it_was():
    """An in-process CLI run (cli.main -> log.setup) gives the freetoken logger a stderr handler
    and turns its propagation off, which hid its records from caplog in every later test (an
    order-dependent failure); put it back after each test."""
    logger = logging.getLogger("freetoken")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level
