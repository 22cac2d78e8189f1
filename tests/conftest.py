"""Markers: ``gpu`` (skipped without a CUDA device) and ``slow`` (skipped unless --slow)."""
import os

import pytest

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run tests marked slow")


def _gpu_reason():
    from freetoken.backend import cuda_unavailable_reason
    return cuda_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    gpu_reason = None
    for item in items:
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with --slow"))
        if "gpu" in item.keywords:
            gpu_reason = gpu_reason or _gpu_reason() or ""
            if gpu_reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu: {gpu_reason}"))


@pytest.fixture
def rng():
    import numpy as np
    return np.random.default_rng(0)
