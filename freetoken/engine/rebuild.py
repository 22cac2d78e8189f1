"""Elastic cache (DESIGN §5.7): resize the expert cache and the KV pool at a safe point.

Validate first, build the new pieces next, swap last: a failure at any point leaves the old
geometry serving. The host expert pool is never reloaded. Residency and counters restart cold.
A new KV pool drops the prefix cache (its slots no longer exist); an expert-cache-only resize
keeps it.
"""
from __future__ import annotations

from freetoken.log import logger


class EngineBusy(RuntimeError):
    """A rebuild was asked while requests are queued or running."""


class RebuildRejected(ValueError):
    """The requested geometry is invalid; nothing was changed."""


def cache_status(core) -> dict:
    moe, kv, tree = core.moe.stats(), core.kv, core.prefix_cache
    return {
        "moe": {"backend": moe.get("backend"), "slots": moe.get("slots"),
                "num_layers": len(core.model_config.moe_layers),
                "num_experts": core.model_config.num_experts, "policy": moe.get("policy")},
        "kv": {"num_tokens": kv.num_slots, "free": kv.num_free, "bytes": kv.bytes,
               "prefix_cached_tokens": tree.size if tree else 0},
        "busy": core.has_work(),
        **({"state_checkpoints": core.checkpoints.status()} if getattr(core, "checkpoints", None) else {}),
    }


def rebuild_cache(core, moe_cache_size: int | None = None, num_kv_tokens: int | None = None) -> dict:
    """Resize the expert cache (slots) and/or the KV pool (tokens); returns the new cache_status."""
    if core.has_work():
        raise EngineBusy("cache rebuild needs an idle engine: requests are queued or running")
    new_config, slots = _validated(core, moe_cache_size, num_kv_tokens)
    old_config, old_slots, resized = core.config, core.moe.stats().get("slots"), False
    try:
        core.config = new_config
        if slots is not None:
            # The runtime resizes its slot pool in place (freeing the old one first, so the device
            # never holds both); it rolls back by itself and re-raises on failure.
            core.moe.rebuild(slots)
            resized = True
        kv = core._make_kv_pool() if num_kv_tokens is not None else core.kv
    except Exception as e:
        core.config = old_config
        if resized:                               # the KV pool failed: the old expert cache back
            core.moe.rebuild(old_slots)
        raise RebuildRejected(f"cache rebuild failed, previous geometry kept: {e}") from e
    _install(core, kv, reset_prefix=kv is not core.kv)
    logger.info("cache rebuilt: expert cache %s slots, KV pool %d tokens",
                core.moe.stats().get("slots"), core.kv.num_slots)
    return cache_status(core)


def _slots(core, config) -> int:
    """The expert cache size config asks for, by the start-up rules (options.cache_slots)."""
    from freetoken.moe.options import Log, cache_slots
    cfg = core.model_config
    return cache_slots(len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok, config, Log(logger))


def _validated(core, moe_cache_size, num_kv_tokens):
    """(the new config, the expert cache's slot count or None when it keeps its size); computed
    once, so that the sizing rules' log lines appear once."""
    from freetoken.config import ConfigError
    changes = {}
    if moe_cache_size is not None:
        backend = core.moe.stats().get("backend")
        if backend not in ("offload", "hybrid"):
            raise RebuildRejected(f"the {backend} MoE backend has no expert cache to resize")
        if not isinstance(moe_cache_size, int) or moe_cache_size < 1:
            raise RebuildRejected(f"moe_cache_size must be a positive integer, got {moe_cache_size!r}")
        changes.update(moe_cache_size=moe_cache_size, moe_cache_rate=0.0, moe_backend=backend)
    if num_kv_tokens is not None:
        if not isinstance(num_kv_tokens, int) or num_kv_tokens < 2:
            raise RebuildRejected(f"num_kv_tokens must be an integer >= 2, got {num_kv_tokens!r}")
        changes.update(num_kv_tokens=num_kv_tokens)
    if not changes:
        raise RebuildRejected("nothing to rebuild: give moe_cache_size and/or num_kv_tokens")
    config, slots = core.config.replace(**changes), None
    if moe_cache_size is not None:
        try:   # the same check as at start-up: at least one decode step's distinct experts
            slots = _slots(core, config)
        except ConfigError as e:
            raise RebuildRejected(str(e)) from e
    return config, slots


def _install(core, kv, reset_prefix: bool) -> None:
    from freetoken.engine.radix import RadixCache
    core.kv = core.model.kv = core.scheduler.kv = kv
    if reset_prefix and core.prefix_cache is not None:
        pool = core.prefix_cache.checkpoints
        if pool is not None:
            pool.clear()                     # they hang from the old tree's nodes
        core.prefix_cache = core.scheduler.cache = RadixCache(pool)
        if core.scheduler.resumer is not None:
            core.scheduler.resumer.cache = core.prefix_cache
    if getattr(core, "graphs", None) is not None:
        core.forward = core._make_forward()     # captured graphs hold the old KV addresses
