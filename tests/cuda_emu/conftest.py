"""The emulator's own tests run on every machine (no `gpu` marker): they load the stand-in directly."""
import pytest


@pytest.fixture
def cp(monkeypatch):
    """The emulated cupy module, whatever FREETOKEN_CUDA_EMULATE says in this process."""
    monkeypatch.setenv("FREETOKEN_CUDA_EMULATE", "1")
    from freetoken.cuda_emu import cupy_standin
    yield cupy_standin
    cupy_standin.cuda.Device().synchronize()
