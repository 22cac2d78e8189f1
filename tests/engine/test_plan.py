"""make_plan: every size and backend, settled once, over (device memory, model geometry, flags), GPU
plans included, with made-up device facts. Pure: runs on a CPU. The GPU memory split's claims add
up, the cap is honoured, each claim or flag that cannot be met is named, and every decision says why."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from freetoken.config import ConfigError, EngineConfig
from freetoken.log import logger
from freetoken.models.demo import packaged_demo_dir
from freetoken.engine import plan_memory as pm
from freetoken.engine.plan import CHECKPOINTS_PER_REQUEST, DeviceFacts, make_plan
from freetoken.engine.plan_resize import resized_plan
from freetoken.engine.plan_moe import step_need
from freetoken.engine.state_pool import StatePool
from freetoken.models.hf_config import model_config_from_dict, read_model_config
from freetoken.models.synth import PRESETS
from freetoken.models.synth_gdn import PRESETS as GDN_PRESETS
from freetoken.moe.profile import Profile

BIG = model_config_from_dict(PRESETS["qwen3-30b-a3b"].hf_config())          # 48 x 128 experts, bf16
QWEN36 = model_config_from_dict(GDN_PRESETS["qwen3.6-35b-a3b"].hf_config())  # a GDN model
DEMO = read_model_config(packaged_demo_dir())                                # 4 x 16 experts
CPU = DeviceFacts(gpu_missing="no GPU here", host_available_bytes=64 << 30)
ONE_EXPERT = 3 * 2048 * 768 * 2
GGUF_Q4_K_M = Path(__file__).parent.parent / "fixtures" / "gguf" / "qwen3moe_256-q4_k_m.gguf"


def read_dense_demo():
    from freetoken.models.loader import load_model
    return load_model("demo", logger).weights


def gpu(free_gb: float, **facts) -> DeviceFacts:
    return DeviceFacts(gpu_missing=None, gpu_name="a test GPU", free_device_bytes=int(free_gb * pm.GB),
                       host_available_bytes=64 << 30, **facts)


def profile(b_p: float, b_h: float) -> Profile:
    return Profile(gpu_uuid="GPU-test", gpu_name="test", format="bf16", expert_bytes=ONE_EXPERT,
                   b_h_gbs=b_h, b_p_gbs=b_p, timestamp="2026-12-02")


def plan(model=BIG, facts=None, **flags):
    return make_plan(model, EngineConfig(**flags), facts if facts is not None else gpu(80))


def why(p, name: str) -> str:
    return next(d.why for d in p.decisions if d.name == name)


# --- the MoE backend, expert slots and fetch policy ------------------------------------------

@pytest.mark.parametrize("free_gb, facts, want", [
    (None, {}, "cpu"),                                       # no GPU: every expert on the CPU
    (140, {}, "fused"),                                      # every expert fits
    (40, {}, "offload"),                                     # no profile: offload
    (40, {"profile": profile(b_p=20.0, b_h=70.0)}, "hybrid"),   # B_H > 2 x B_P
    (40, {"profile": profile(b_p=30.0, b_h=60.0)}, "offload"),  # exactly 2x: not more
])
def test_auto_moe_backend(free_gb, facts, want):
    p = plan(facts=CPU if free_gb is None else gpu(free_gb, **facts))
    assert p.moe.backend == want and why(p, "moe backend").startswith("auto: ")
    assert (p.compute == "cuda") == (free_gb is not None)


@pytest.mark.parametrize("free_gb", [140, 80, 40, 20])
def test_gpu_claims_fit_the_budget_and_slots_take_what_is_left(free_gb):
    p = plan(facts=gpu(free_gb))
    m = p.memory
    assert m.budget_bytes == int(free_gb * pm.GB * (1 - pm.RESERVE)) and m.capped_by == "free memory"
    slots = m.total_experts if p.moe.backend == "fused" else p.moe.slots
    used = m.weights_bytes + m.workspace_bytes + m.kv_bytes + slots * ONE_EXPERT
    assert used <= m.budget_bytes
    assert p.moe.backend == "fused" or m.budget_bytes - used < ONE_EXPERT     # within one expert


def test_weights_count_everything_but_routed_experts():
    H, L = 2048, 48
    per_layer = (32 + 8) * 128 * H + H * 32 * 128 + 2 * H + 2 * 128 + 128 * H
    assert pm.weight_bytes(BIG, 2) == 2 * (2 * 151936 * H + H + L * per_layer)


def test_the_cap_is_honoured_and_a_cap_above_free_memory_is_free_memory():
    p = plan(facts=gpu(140), gpu_memory_gb=30.0)
    assert p.memory.budget_bytes == int(30 * pm.GB) and p.memory.capped_by == "--gpu-memory-gb"
    assert p.moe.backend == "offload" and "budget 30.00 GB" in dict((d.name, d.value) for d in p.decisions)["gpu memory"]
    p = plan(facts=gpu(80), gpu_memory_gb=500.0)
    assert p.memory.capped_by == "free memory" and p.memory.budget_bytes < 80 * pm.GB


def test_kv_auto_is_shared_but_keeps_one_context():
    assert plan(facts=gpu(140), max_model_len=40960).kv_tokens == 4 * 40960
    assert plan(facts=gpu(16), max_model_len=40960).kv_tokens == 40960      # share cap below one context
    host = plan(facts=CPU, max_model_len=40960)                              # host: capped at 1 GiB
    assert host.kv_tokens == pm.HOST_KV_BUDGET // pm.kv_bytes_per_token(BIG, 2) and "capped" in why(host, "kv pool")


def test_explicit_sizes_are_exact_or_refused_naming_the_flag():
    p = plan(facts=gpu(80), num_kv_tokens=1000, moe_backend="offload", moe_cache_size=100)
    assert p.kv_tokens == 1000 and p.moe.slots == 100 and why(p, "expert cache") == "--moe-cache-size"
    assert plan(facts=gpu(80), moe_backend="hybrid", moe_cache_rate=0.25).moe.slots == round(0.25 * 48 * 128)
    with pytest.raises(ConfigError, match="--moe-cache-size: an expert cache of 6000 slots does not fit"):
        plan(facts=gpu(40), moe_backend="offload", moe_cache_size=6000)
    with pytest.raises(ConfigError, match="--num-kv-tokens: a KV cache of"):
        plan(facts=gpu(80), num_kv_tokens=10**8)


def test_a_cache_larger_than_every_expert_is_every_expert():
    p = plan(facts=gpu(140), moe_backend="offload", moe_cache_size=10**6)
    assert p.moe.slots == 48 * 128 and "are enough" in why(p, "expert cache")
    assert plan(facts=gpu(80), moe_backend="offload", moe_cache_rate=0.1).moe.slots == 615   # ceil(614.4)


def test_fused_needs_every_expert_and_cpu_needs_none():
    with pytest.raises(ConfigError, match="--moe-backend fused needs all 6144 experts"):
        plan(facts=gpu(40), moe_backend="fused")
    assert plan(facts=gpu(140), moe_backend="fused").moe.backend == "fused"
    p = plan(facts=gpu(20), moe_backend="cpu")
    assert p.moe.slots == 0 and p.moe.policy is None


def test_no_room_for_slots_still_runs_hybrid_on_one():
    roomy = plan(facts=gpu(8), moe_backend="hybrid", max_model_len=4096).memory
    per_token = pm.kv_bytes_per_token(BIG, 2)
    tokens = (roomy.expert_room_bytes + roomy.kv_bytes) // per_token - 1   # KV takes all but < 1 expert
    p = plan(facts=gpu(8), moe_backend="hybrid", max_model_len=4096, num_kv_tokens=tokens)
    assert p.memory.fit_slots == 0 and p.moe.slots == 1 and "no room" in why(p, "expert cache")


def test_host_default_cache_is_a_quarter_and_at_least_one_step():
    need = step_need(16, 4, 4)
    p = plan(DEMO, CPU, moe_backend="hybrid")
    assert p.moe.slots == max(16, need) and "default" in why(p, "expert cache")


def test_offload_below_one_step_falls_back_to_hybrid_with_a_warning():
    p = plan(DEMO, CPU, moe_backend="offload", moe_cache_size=2, max_running_requests=2)
    assert p.moe.backend == "hybrid" and p.moe.slots == 2
    assert (p.moe.policy.kind, p.moe.policy.cap) == ("cap", 16)            # every miss that finds a slot
    assert any("offload falls back to hybrid" in w for w in p.warnings)
    big_enough = plan(DEMO, CPU, moe_backend="offload", moe_cache_size=8, max_running_requests=2)
    assert big_enough.moe.backend == "offload" and big_enough.moe.policy.kind == "all" and not big_enough.warnings


@pytest.mark.parametrize("flags, facts, kind, source", [
    ({"moe_hybrid_max_fetch": 5, "moe_min_fill": 1}, {}, "cap", "--moe-hybrid-max-fetch"),
    ({"moe_fetch_fraction": 0.3}, {}, "fraction", "--moe-fetch-fraction"),
    ({}, {"profile": profile(b_p=20.0, b_h=70.0)}, "fraction", "phi from the bandwidth profile"),
    ({}, {}, "cap", "hybrid: no bandwidth profile"),
])
def test_hybrid_fetch_policy(flags, facts, kind, source):
    p = plan(facts=gpu(40, **facts), moe_backend="hybrid", **flags)
    assert p.moe.policy.kind == kind and why(p, "fetch policy").startswith(source)
    assert bool(p.warnings) == (source == "hybrid: no bandwidth profile")


def test_a_pool_that_could_not_be_pinned_plans_cpu():
    p = plan(facts=gpu(40, host_pinned=False), moe_backend="hybrid")
    assert p.moe.backend == "cpu" and p.moe.policy is None and any("pinning it failed" in w for w in p.warnings)


# --- compute backend, context, graphs, checkpoints -------------------------------------------

def test_compute_backend():
    assert plan(facts=CPU).compute == "cpu" and "no GPU here" in why(plan(facts=CPU), "compute")
    assert plan(facts=CPU, backend="ref").compute == "ref"
    with pytest.raises(ConfigError, match="--backend cuda: no GPU here"):
        plan(facts=CPU, backend="cuda")


def test_context_beyond_the_trained_length_runs_with_a_warning():
    p = plan(DEMO, CPU, max_model_len=4096)
    assert p.context_len == 4096 and any("beyond the 2048 positions" in w for w in p.warnings)
    assert plan(DEMO, CPU).context_len == 2048 and not plan(DEMO, CPU).warnings


@pytest.mark.parametrize("facts, flags, want", [
    (gpu(8), {}, True), (gpu(8), {"cuda_graph": False}, False),
    (gpu(8), {"moe_backend": "offload"}, False), (CPU, {}, False),
])
def test_cuda_graphs_need_cuda_and_fused(facts, flags, want):
    assert plan(DEMO, facts, **flags).cuda_graphs is want


def test_fp32_weights_count_four_bytes():
    p16, p32 = plan(DEMO, CPU), plan(DEMO, dataclasses.replace(CPU, weights_dtype="f32"))
    assert p32.kv_dtype == "float32" and p16.kv_dtype == "bfloat16"
    g16, g32 = plan(BIG, gpu(80), moe_backend="offload"), plan(BIG, gpu(80, weights_dtype="f32"), moe_backend="offload")
    assert g32.memory.one_expert_bytes == 2 * g16.memory.one_expert_bytes == 2 * ONE_EXPERT
    assert g32.memory.weights_bytes == 2 * g16.memory.weights_bytes and g32.moe.slots < g16.moe.slots


def test_quantized_weights_count_their_stored_bytes():
    """A Q4_K model's slots hold its blocks: the plan takes the stored sizes from the facts, so the
    same GPU memory holds about 3.5x the bf16 slots."""
    q4k_expert = 3 * 2048 * 768 // 256 * 144
    g16 = plan(BIG, gpu(24), moe_backend="offload")
    gq = plan(BIG, gpu(24, stored_bytes=(g16.memory.weights_bytes // 3, q4k_expert)),
              moe_backend="offload")
    assert gq.memory.one_expert_bytes == q4k_expert and gq.memory.weights_bytes == g16.memory.weights_bytes // 3
    assert gq.moe.slots > 3.4 * g16.moe.slots
    # its norms widened to f32 do not make the KV f32: blocks keep a bf16 cache, twice the tokens
    f32_norms = dataclasses.replace(CPU, weights_dtype="f32", stored_bytes=(10 << 20, q4k_expert))
    assert plan(DEMO, f32_norms).kv_dtype == "bfloat16" and plan(DEMO, f32_norms, kv_dtype="float32").kv_dtype == "float32"


def test_stored_bytes_of_a_quantized_gguf_are_what_the_device_holds():
    from freetoken.engine.facts import expert_format, stored_bytes
    from freetoken.models.loader import load_model
    loaded = load_model(str(GGUF_Q4_K_M), logger)
    w, moe = loaded.weights, loaded.config.moe_layers
    dense, slot = stored_bytes(w, moe)
    from freetoken.moe.pool import Bank, slot_pool
    pool = slot_pool(np, 1, [Bank(w.layers[i].gate_up, w.layers[i].down) for i in moe])
    assert slot == pool[0].nbytes + pool[1].nbytes                   # what the runtime allocates
    assert expert_format(w, moe) == "q4_k" and dense < w.embed.nbytes * 8
    demo = read_dense_demo()
    assert stored_bytes(demo, (0, 1, 2, 3)) is None and expert_format(demo, (0,)) == "bf16"


def test_a_gdn_models_device_checkpoints_get_only_what_the_expert_cache_leaves_unless_asked():
    tight = plan(QWEN36, gpu(40))
    assert tight.moe.backend == "offload" and tight.checkpoint_device_bytes < pm.expert_bytes(QWEN36, 2)
    roomy = plan(QWEN36, gpu(140))
    assert roomy.moe.backend == "fused" and roomy.checkpoint_device_bytes == roomy.checkpoint_host_bytes
    asked = plan(QWEN36, gpu(40), state_checkpoint_gpu_mb=2048)
    assert asked.checkpoint_device_bytes == 2048 << 20 and asked.moe.slots < tight.moe.slots
    assert plan(QWEN36, gpu(140), state_checkpoint_gpu_mb=0).checkpoint_device_bytes == 0
    with pytest.raises(ConfigError, match="--state-checkpoint-gpu-mb 900000 does not fit"):
        plan(QWEN36, gpu(140), state_checkpoint_gpu_mb=900000)
    assert plan(BIG, gpu(140)).checkpoint_device_bytes == 0 and plan(BIG, gpu(140)).state_rows == 0


def test_host_checkpoint_budget():
    row = StatePool.bytes_per_row(QWEN36)
    p = plan(QWEN36, CPU, max_running_requests=2)
    assert (p.checkpoint_host_bytes, p.checkpoint_device_bytes) == (2 * CHECKPOINTS_PER_REQUEST * row, 0)
    p = plan(QWEN36, dataclasses.replace(CPU, host_available_bytes=8 << 30))
    assert p.checkpoint_host_bytes == 1 << 30 and "at most 1/8 of 8.0 GiB" in why(p, "checkpoints (host)")
    p = plan(QWEN36, gpu(140), state_checkpoint_mb=100, state_checkpoint_gpu_mb=0)
    assert (p.checkpoint_host_bytes, p.checkpoint_device_bytes) == (100 << 20, 0)
    p = plan(QWEN36, CPU, state_checkpoint_mb=0)
    assert not p.prefix_cache and "--state-checkpoint-mb is 0" in why(p, "prefix cache")


# --- flags, resizes, the summary -------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    ({"moe_cache_size": 8, "moe_cache_rate": 0.5}, "mutually exclusive"),
    ({"moe_cache_rate": 1.5}, "--moe-cache-rate is a fraction"),
    ({"moe_cache_size": 0}, "--moe-cache-size must be >= 1"),
    ({"max_running_requests": 0}, "--max-running-requests must be >= 1"),
    ({"num_kv_tokens": 1}, "--num-kv-tokens must be >= 2"),
    ({"moe_fetch_fraction": -1.0}, "--moe-fetch-fraction must be >= 0"),
    ({"gpu_memory_gb": 0.0}, "--gpu-memory-gb must be > 0"),
    ({"moe_backend": "gpu-magic"}, "--moe-backend 'gpu-magic'; expected one of"),
    ({"num_kv_tokens": 2.5}, "--num-kv-tokens must be an integer"),
])
def test_each_bad_flag_is_one_error_naming_it(flags, message):
    with pytest.raises(ConfigError, match=message):
        plan(DEMO, CPU, **flags)


def test_a_resize_keeps_the_backend_policy_and_every_other_decision():
    """An auto-chosen backend and a profile's policy stay what start-up chose (the flags say
    nothing of them); only the changed decisions change, each with the field that changed it."""
    facts, ec = gpu(40, profile=profile(b_p=20.0, b_h=70.0)), EngineConfig()
    start = make_plan(BIG, ec, facts)
    assert start.moe.backend == "hybrid" and start.moe.policy.kind == "fraction"
    grown = resized_plan(BIG, ec, facts, start, expert_slots=start.moe.slots - 100)
    assert (grown.moe.backend, grown.moe.policy) == ("hybrid", start.moe.policy) and grown.kv_tokens == start.kv_tokens
    changed = {d.name for d in grown.decisions} ^ {d.name for d in start.decisions}
    assert not changed and [d.name for d in grown.decisions if d not in start.decisions] == ["expert cache", "gpu memory"]
    assert why(grown, "moe backend").startswith("auto: ") and why(grown, "expert cache") == "moe_cache_size"
    kv = resized_plan(BIG, ec, facts, grown, kv_tokens=4096)
    assert kv.kv_tokens == 4096 and kv.moe.slots == grown.moe.slots            # the earlier resize stays
    with pytest.raises(ConfigError, match="num_kv_tokens: an expert cache of .* do not fit"):
        resized_plan(BIG, ec, facts, start, kv_tokens=4 * 40960)               # the auto cache took the room


def test_a_resize_checks_like_start_up():
    cpu = plan(DEMO, CPU)
    with pytest.raises(ConfigError, match="the cpu MoE backend has no expert cache to resize"):
        resized_plan(DEMO, EngineConfig(), CPU, cpu, expert_slots=4)
    offload = plan(DEMO, CPU, moe_backend="offload", moe_cache_size=20)
    with pytest.raises(ConfigError, match="offload needs at least"):
        resized_plan(DEMO, EngineConfig(moe_backend="offload"), CPU, offload, expert_slots=1)
    for bad, message in (({"expert_slots": 0}, "moe_cache_size must be >= 1"),
                         ({"kv_tokens": 1}, "num_kv_tokens must be >= 2"),
                         ({"kv_tokens": 2.5}, "num_kv_tokens must be an integer")):
        with pytest.raises(ConfigError, match=message):
            resized_plan(DEMO, EngineConfig(), CPU, offload, **bad)


def test_a_resize_keeps_the_device_checkpoints_out_of_the_expert_cache():
    """A GDN model's device checkpoint tier (the spare start-up left) is kept by a resize, so the
    expert cache cannot grow into it."""
    ec = EngineConfig(moe_backend="hybrid", moe_cache_size=2000)
    start = plan(QWEN36, gpu(60), **{"moe_backend": "hybrid", "moe_cache_size": 2000})
    assert start.checkpoint_device_bytes > 0
    room = start.memory.expert_room_bytes - start.checkpoint_device_bytes
    fit = room // start.memory.one_expert_bytes
    assert 2000 < fit < start.memory.fit_slots                 # the tier, not the split, is the bound
    assert resized_plan(QWEN36, ec, gpu(60), start, expert_slots=fit).moe.slots == fit
    with pytest.raises(ConfigError, match="moe_cache_size: an expert cache of"):
        resized_plan(QWEN36, ec, gpu(60), start, expert_slots=fit + 1)


def test_the_summary_and_the_json_name_every_decision():
    p = plan(QWEN36, gpu(40), moe_backend="hybrid")
    names = [d.name for d in p.decisions]
    for name in ("compute", "context", "kv dtype", "kv pool", "moe backend", "expert cache", "fetch policy",
                 "gpu memory", "cuda graphs", "checkpoints (host)", "checkpoints (device)", "prefix cache"):
        assert name in names and name in p.summary()
    assert all(d.why for d in p.decisions)
    body = json.loads(json.dumps(p.as_dict()))
    assert body["moe_backend"] == "hybrid" and len(body["decisions"]) == len(p.decisions)


