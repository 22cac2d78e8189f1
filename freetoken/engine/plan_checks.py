"""Every engine flag's bounds, checked once (the start-up plan runs this first; start-up also runs it
before loading a model, so a bad flag fails in a second). One ConfigError naming the flag.

None is "auto" everywhere (config.EngineConfig); choices are enforced by the parser and again here
for EngineConfig objects built in Python (LLM(...), tests).
"""
from __future__ import annotations

from dataclasses import fields

from freetoken.config import ConfigError, EngineConfig

# field -> (lowest allowed, highest allowed or None); None values (auto) are not checked
BOUNDS = {
    "max_running_requests": (1, None),
    "num_kv_tokens": (2, None),           # one prompt token and one generated token
    "max_model_len": (2, None),
    "chunked_prefill_size": (1, None),
    "state_checkpoint_mb": (0, None),
    "state_checkpoint_gpu_mb": (0, None),
    "state_checkpoint_interval": (0, None),
    "moe_cache_size": (1, None),
    "moe_hybrid_max_fetch": (0, None),
    "moe_fetch_fraction": (0.0, None),
    "moe_prefill_decode_tokens": (0, None),
    "moe_cpu_threads": (1, None),
}
POSITIVE = ("moe_cache_rate", "gpu_memory_gb")     # > 0 (and the rate at most 1)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_config(config: EngineConfig) -> None:
    """Raise ConfigError for the first flag out of its bounds or choices."""
    for name, (lo, hi) in BOUNDS.items():
        _check_range(name, getattr(config, name), lo, hi)
    for name in POSITIVE:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{flag(name)} must be > 0, got {value}")
    if config.moe_cache_rate is not None and config.moe_cache_rate > 1:
        raise ConfigError(f"--moe-cache-rate is a fraction of all experts in (0, 1], got {config.moe_cache_rate}")
    if config.moe_cache_size is not None and config.moe_cache_rate is not None:
        raise ConfigError(f"--moe-cache-size ({config.moe_cache_size}) and --moe-cache-rate "
                          f"({config.moe_cache_rate}) are mutually exclusive; give one of them")
    for f in fields(config):
        choices = f.metadata.get("choices")
        if choices and getattr(config, f.name) not in choices:
            raise ConfigError(f"{flag(f.name)} {getattr(config, f.name)!r}; expected one of "
                              f"{', '.join(map(str, choices))}")


def _check_range(name: str, value, lo, hi) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(lo, int) and not isinstance(value, int):
        raise ConfigError(f"{flag(name)} must be {'an integer' if isinstance(lo, int) else 'a number'}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{flag(name)} must be {bound}, got {value}")
