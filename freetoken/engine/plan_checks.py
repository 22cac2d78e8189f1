"""Every engine flag's bounds, checked once (the start-up plan runs this first; start-up also runs it
before loading a model, so a bad flag fails in a second). One ConfigError naming the flag.

None is "auto" everywhere (config.EngineConfig); choices are enforced by the parser and again here
for EngineConfig objects built in Python (LLM(...), tests).
"""
from __future__ import annotations

from dataclasses import fields

from freetoken.config import ConfigError, EngineConfig

# field -> the lowest value allowed; None values (auto) are not checked
BOUNDS = {
    "max_running_requests": 1,
    "num_kv_tokens": 2,           # one prompt token and one generated token
    "max_model_len": 2,
    "chunked_prefill_size": 1,
    "state_checkpoint_mb": 0,
    "state_checkpoint_gpu_mb": 0,
    "state_checkpoint_interval": 0,
    "moe_cache_size": 1,
    "moe_hybrid_max_fetch": 0,
    "moe_fetch_fraction": 0.0,
    "moe_prefill_decode_tokens": 0,
    "moe_cpu_threads": 1,
}
POSITIVE = ("moe_cache_rate", "gpu_memory_gb")     # > 0 (and the rate at most 1)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_config(config: EngineConfig) -> None:
    """Raise ConfigError for the first flag out of its bounds or choices."""
    for name, lo in BOUNDS.items():
        check_value(flag(name), getattr(config, name), lo)
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


def check_value(label: str, value, lo) -> None:
    """value (None: not given) is a number of lo's kind, at least lo; label names it in the error
    (a flag, or a request field of a resize)."""
    if value is None:
        return
    integer = isinstance(lo, int)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ConfigError(f"{label} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value < lo:
        raise ConfigError(f"{label} must be >= {lo}, got {value}")
