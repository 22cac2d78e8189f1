"""plan_gpu_memory: the four claims add up, the cap is honoured, and each claim that does not fit
is named. Pure arithmetic: runs on a CPU."""
import dataclasses
import re

import pytest

from freetoken.config import ConfigError, EngineConfig
from freetoken.models.hf_config import model_config_from_dict, read_model_config
from freetoken.demo import packaged_demo_dir
from freetoken.engine import gpu_budget as gb
from freetoken.models.synth import PRESETS

# --gpu-memory-gb is an EngineConfig field the CLI adds; a subclass stands in until it lands
Capped = dataclasses.make_dataclass("Capped", [("gpu_memory_gb", float, 0.0)],
                                    bases=(EngineConfig,), frozen=True)
BIG = model_config_from_dict(PRESETS["qwen3-30b-a3b"].hf_config())   # 48 x 128 experts, bf16


def _sum(p):
    return p.weights_bytes + p.workspace_bytes + p.kv_bytes + p.expert_bytes


@pytest.mark.parametrize("free_gb", [140, 80, 40, 20])
def test_claims_fit_the_budget(free_gb):
    p = gb.plan_gpu_memory(BIG, EngineConfig(), int(free_gb * gb.GB))
    assert p.budget_bytes == int(free_gb * gb.GB * (1 - gb.RESERVE)) and p.capped_by == "free memory"
    assert _sum(p) <= p.budget_bytes
    # expert slots take everything left, to within one expert
    assert p.fits_all_experts or p.budget_bytes - _sum(p) < gb.expert_bytes(BIG)
    assert p.expert_bytes == p.expert_slots * 3 * 2048 * 768 * 2


def test_weights_count_everything_but_routed_experts():
    # 2 x (V x H) untied + per layer qkv, o_proj, norms, router; bf16
    H, L = 2048, 48
    per_layer = (32 + 8) * 128 * H + H * 32 * 128 + 2 * H + 2 * 128 + 128 * H
    assert gb.weight_bytes(BIG) == 2 * (2 * 151936 * H + H + L * per_layer)


def test_cap_is_honoured_and_described():
    p = gb.plan_gpu_memory(BIG, Capped(gpu_memory_gb=30.0), int(140 * gb.GB))
    assert p.budget_bytes == int(30 * gb.GB) and p.capped_by == "--gpu-memory-gb"
    assert _sum(p) <= p.budget_bytes and not p.fits_all_experts
    line = p.describe()
    assert re.fullmatch(r"budget 30\.0 GB: weights \d+\.\d GB, KV \d+\.\d GB \(\d+ tokens\), "
                        r"expert cache \d+\.\d GB \(\d+ slots = \d+% of experts\), "
                        r"workspace \d+\.\d GB", line), line
    assert f"({p.expert_slots} slots = {round(100 * p.expert_slots / (48 * 128))}% " in line


def test_cap_above_free_memory_uses_free_memory():
    p = gb.plan_gpu_memory(BIG, Capped(gpu_memory_gb=500.0), int(80 * gb.GB))
    assert p.capped_by == "free memory" and p.budget_bytes < 80 * gb.GB


def test_kv_auto_is_shared_but_keeps_one_context():
    ec = EngineConfig(max_running_requests=4, max_model_len=40960)
    roomy = gb.plan_gpu_memory(BIG, ec, int(140 * gb.GB))
    assert roomy.kv_tokens == 4 * 40960                         # what 4 full contexts need
    tight = gb.plan_gpu_memory(BIG, ec, int(16 * gb.GB))
    assert tight.kv_tokens == 40960                             # share cap below one context


def test_explicit_sizes_are_exact_or_refused():
    p = gb.plan_gpu_memory(BIG, EngineConfig(num_kv_tokens=1000, moe_cache_size=100), int(80 * gb.GB))
    assert p.kv_tokens == 1000 and p.expert_slots == 100
    p = gb.plan_gpu_memory(BIG, EngineConfig(moe_cache_rate=0.25), int(80 * gb.GB))
    assert p.expert_slots == round(0.25 * 48 * 128)
    with pytest.raises(ConfigError, match="expert cache of 6000 slots"):
        gb.plan_gpu_memory(BIG, EngineConfig(moe_cache_size=6000), int(40 * gb.GB))
    with pytest.raises(ConfigError, match="KV cache of"):
        gb.plan_gpu_memory(BIG, EngineConfig(num_kv_tokens=10**8), int(80 * gb.GB))


def test_a_cache_larger_than_every_expert_is_every_expert():
    """Found by the emulated run of test_gpu_moe: 18 slots asked of 12 experts was refused as
    "does not fit" with 1.8 GB free; the runtime uses L*E there, and so must the plan."""
    p = gb.plan_gpu_memory(BIG, EngineConfig(moe_cache_size=10**6), int(140 * gb.GB))
    assert p.expert_slots == 48 * 128
    p = gb.plan_gpu_memory(BIG, EngineConfig(moe_cache_rate=0.1), int(80 * gb.GB))
    assert p.expert_slots == 615                           # ceil(614.4), as moe/options.cache_slots


def test_fused_needs_every_expert_and_cpu_needs_none():
    with pytest.raises(ConfigError, match="6144 slots"):
        gb.plan_gpu_memory(BIG, EngineConfig(moe_backend="fused"), int(40 * gb.GB))
    assert gb.plan_gpu_memory(BIG, EngineConfig(moe_backend="fused"), int(140 * gb.GB)).fits_all_experts
    assert gb.plan_gpu_memory(BIG, EngineConfig(moe_backend="cpu"), int(20 * gb.GB)).expert_slots == 0


def test_weights_that_do_not_fit_are_named():
    with pytest.raises(ConfigError, match="weights .* exceed the GPU budget"):
        gb.plan_gpu_memory(BIG, EngineConfig(), int(4 * gb.GB))


def test_demo_model_fits_whole():
    demo = read_model_config(packaged_demo_dir())
    p = gb.plan_gpu_memory(demo, EngineConfig(), int(8 * gb.GB))
    assert p.fits_all_experts and p.expert_slots == 4 * 16 and p.workspace_bytes >= gb.MIN_WORKSPACE


def test_fp32_checkpoints_count_four_bytes():
    f32 = dataclasses.replace(BIG, torch_dtype="float32")
    assert gb.expert_bytes(f32) == 2 * gb.expert_bytes(BIG)
    assert gb.kv_bytes_per_token(f32, EngineConfig()) == 2 * gb.kv_bytes_per_token(BIG, EngineConfig())


QWEN36 = model_config_from_dict(__import__("freetoken.models.synth_gdn", fromlist=["PRESETS"])
                               .PRESETS["qwen3.6-35b-a3b"].hf_config())


def test_a_hybrids_checkpoints_get_only_what_the_expert_cache_leaves_unless_asked():
    """Default: the device tier of state checkpoints is what is left once every expert is cached
    (a GPU that holds them all), never an expert slot; --state-checkpoint-gpu-mb N is claimed
    before the expert cache, or refused with the numbers; a non-hybrid gets none."""
    tight = gb.plan_gpu_memory(QWEN36, EngineConfig(), int(40 * gb.GB))
    assert not tight.fits_all_experts and tight.checkpoint_bytes < gb.expert_bytes(QWEN36)
    roomy = gb.plan_gpu_memory(QWEN36, EngineConfig(), int(140 * gb.GB))
    assert roomy.fits_all_experts and roomy.checkpoint_bytes > 10 * gb.GB
    assert _sum(roomy) + roomy.state_bytes + roomy.checkpoint_bytes <= roomy.budget_bytes
    asked = gb.plan_gpu_memory(QWEN36, EngineConfig(state_checkpoint_gpu_mb=2048), int(40 * gb.GB))
    assert asked.checkpoint_bytes == 2048 << 20 and asked.expert_slots < tight.expert_slots
    assert gb.plan_gpu_memory(QWEN36, EngineConfig(state_checkpoint_gpu_mb=0), int(140 * gb.GB)).checkpoint_bytes == 0
    with pytest.raises(ConfigError, match="--state-checkpoint-gpu-mb 900000 does not fit"):
        gb.plan_gpu_memory(QWEN36, EngineConfig(state_checkpoint_gpu_mb=900000), int(140 * gb.GB))
    assert gb.plan_gpu_memory(BIG, EngineConfig(), int(140 * gb.GB)).checkpoint_bytes == 0
    assert "state checkpoints" in roomy.describe()
