"""Elastic cache (docs/design.md, Elastic cache resize): resize the expert cache and the KV pool at a
safe point. The new sizes are a new plan (engine/plan_resize.py: the same checks as at start-up);
EngineCore.rebuild(plan) then replaces what changed.

Plan first, build the new pieces next, swap last: a failure at any point leaves the old geometry
serving. The host expert pool is never reloaded. Residency and counters restart cold. A new KV pool
drops the prefix cache (its slots no longer exist); an expert-cache-only resize keeps it.
"""
from __future__ import annotations

from freetoken.engine.request import EngineBusy
from freetoken.log import logger


class RebuildRejected(ValueError):
    """The requested geometry is invalid or could not be built; nothing was changed."""


def cache_status(core) -> dict:
    moe, kv, tree = core.moe.stats(), core.kv, core.prefix_cache
    return {
        "moe": {"backend": moe.get("backend"), "slots": moe.get("slots"),
                "num_layers": len(core.model_config.moe_layers),
                "num_experts": core.model_config.num_experts, "policy": moe.get("policy")},
        "kv": {"num_tokens": kv.num_slots, "free": kv.num_free, "bytes": kv.bytes,
               "prefix_cached_tokens": tree.size if tree else 0},
        "busy": core.has_work(),
        "plan": core.plan.as_dict(),
        **({"state_checkpoints": core.checkpoints.status()} if getattr(core, "checkpoints", None) else {}),
    }


def resize_plan(core, moe_cache_size: int | None, num_kv_tokens: int | None):
    """The plan with the new sizes (engine/plan_resize.py), or RebuildRejected saying why not."""
    from freetoken.config import ConfigError
    from freetoken.engine.plan_resize import resized_plan
    if moe_cache_size is None and num_kv_tokens is None:
        raise RebuildRejected("nothing to rebuild: give moe_cache_size and/or num_kv_tokens")
    try:
        return resized_plan(core.model_config, core.config, core.facts, core.plan, moe_cache_size, num_kv_tokens)
    except ConfigError as e:
        raise RebuildRejected(str(e)) from None


def rebuilt(core, plan):
    """Resize the expert cache in place and build the new KV pool (None when its size stays);
    on failure roll the expert cache back and raise RebuildRejected. The caller swaps."""
    from freetoken.engine.build import make_kv_pool
    if core.has_work():
        raise EngineBusy("cache rebuild needs an idle engine: requests are queued or running")
    old, resized = core.plan.moe.slots, False
    try:
        if plan.moe.slots != old:
            # The runtime frees the old slot pool first (the device never holds both); it rolls
            # back by itself and re-raises on failure.
            core.moe.rebuild(plan.moe.slots)
            resized = True
        if plan.kv_tokens == core.kv.num_slots:
            return None
        return make_kv_pool(core.model_config, plan, core.ops.xp)
    except Exception as e:
        if resized:                               # the KV pool failed: the old expert cache back
            core.moe.rebuild(old)
        logger.warning("cache rebuild failed, previous geometry kept: %s", e)
        raise RebuildRejected(f"cache rebuild failed, previous geometry kept: {e}") from e
