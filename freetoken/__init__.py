"""FreeToken: an MoE LLM serving engine for one machine whose GPU cannot hold all the experts.

Public API: ``LLM``, ``SamplingParams``, ``EngineConfig``. Importing this package is cheap and has
no side effects: heavy modules (numba, cupy, starlette) load on first use.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from freetoken.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from freetoken.engine.request import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from freetoken.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
