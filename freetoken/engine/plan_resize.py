"""An elastic resize as a plan: the previous plan with a new expert-cache size and/or KV pool, and
everything else kept (the MoE backend, its fetch policy, the checkpoint budgets, every other
decision with its reason). The same checks as at start-up; a ConfigError names the request field.
Pure, like plan.py; EngineCore.rebuild(plan) then builds what changed.
"""
from __future__ import annotations

from dataclasses import replace

from freetoken.config import ConfigError, EngineConfig, ModelConfig
from freetoken.engine.plan import (DeviceFacts, Plan, kv_itemsize, memory_decision, slots_on_gpu,
                                   weight_itemsize)
from freetoken.engine.plan_checks import check_value
from freetoken.engine.plan_memory import split_gpu_memory
from freetoken.engine.plan_moe import Decision, offload_too_small, step_need
from freetoken.moe.runtime import CACHED


def resized_plan(model: ModelConfig, config: EngineConfig, facts: DeviceFacts, previous: Plan,
                 expert_slots: int | None = None, kv_tokens: int | None = None) -> Plan:
    check_value("moe_cache_size", expert_slots, 1)
    check_value("num_kv_tokens", kv_tokens, 2)
    changed = {}
    moe = previous.moe
    if expert_slots is not None:
        moe, changed["expert cache"] = _expert_cache(model, config, moe, expert_slots)
    tokens = previous.kv_tokens if kv_tokens is None else kv_tokens
    if kv_tokens is not None:
        changed["kv pool"] = Decision("kv pool", f"{tokens} tokens", "num_kv_tokens")
    plan = replace(previous, kv_tokens=tokens, moe=moe)
    if previous.memory is not None:
        plan = _fits_the_gpu(model, config, facts, plan, previous, expert_slots is not None)
        changed["gpu memory"] = memory_decision(plan.memory, slots_on_gpu(plan.memory, moe, model))
    return replace(plan, decisions=tuple(changed.get(d.name, d) for d in previous.decisions))


def _expert_cache(model: ModelConfig, config: EngineConfig, moe, slots: int):
    if moe.backend not in CACHED:
        raise ConfigError(f"moe_cache_size: the {moe.backend} MoE backend has no expert cache to resize")
    total, why = len(model.moe_layers) * model.num_experts, "moe_cache_size"
    if slots > total:
        slots, why = total, f"moe_cache_size; {slots} asked, {total} (= Lm*E) are enough"
    need = step_need(model.num_experts, model.num_experts_per_tok, config.max_running_requests)
    if moe.backend == "offload" and slots < need:
        raise ConfigError(f"moe_cache_size: {offload_too_small(slots, need, model.num_experts_per_tok)}; offload "
                          f"needs at least {need} (or a restart with --moe-backend hybrid, which runs at any "
                          "cache size)")
    return replace(moe, slots=slots), Decision("expert cache", str(slots), why)


def _fits_the_gpu(model, config, facts, plan: Plan, previous: Plan, slots_asked: bool) -> Plan:
    """The GPU split for the new KV pool; the expert cache must fit what it leaves once the device
    checkpoint tier, which a resize keeps, is taken."""
    memory, _ = split_gpu_memory(model, config, facts.free_device_bytes, weight_itemsize(facts),
                                 kv_itemsize(plan.kv_dtype), plan.context_len, plan.kv_tokens,
                                 facts.stored_bytes)
    held = previous.checkpoint_device_bytes - memory.checkpoint_claim_bytes   # the auto tier's bytes
    memory = replace(memory, expert_room_bytes=memory.expert_room_bytes - max(held, 0))
    slots = slots_on_gpu(memory, plan.moe, model)
    if slots > memory.fit_slots:
        field = "moe_cache_size" if slots_asked else "num_kv_tokens"
        raise ConfigError(f"{field}: an expert cache of {slots} slots and a KV pool of {plan.kv_tokens} tokens do not "
                          f"fit the GPU memory plan together: it has room for {memory.fit_slots} slots beside that KV "
                          "pool")
    return replace(plan, memory=memory)
