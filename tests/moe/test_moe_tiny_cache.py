"""Hybrid runs at any expert cache size (docs/moe.md, "Any cache size"): start-up rules (the plan, engine/plan_moe.py),
both runtimes at 1-3 slots against fused, and the command line at --moe-cache-size 1.

The residency step's own invariants at every S are in test_moe_residency.py; the kernel's, against
the spec at S = 1..3, in test_gpu_residency.py."""
import re
import subprocess
import sys

import numpy as np
import pytest
from moe_helpers import (E, H, I, K, L, StagingHostDevice, engine, model_config, np_experts, planned,
                         random_banks, run, workload)

from freetoken.config import ConfigError
from freetoken.engine.plan import DeviceFacts, make_plan
from freetoken.engine.plan_resize import resized_plan
from freetoken.engine.plan_moe import step_need
from freetoken.moe.runtime import build_moe

NEED = step_need(E, K, 2)           # moe_helpers.engine runs max_running_requests 2: 4 distinct
POLICIES = {
    "fallback-cap1": {},
    "phi0.3": dict(moe_fetch_fraction=0.3),
    "phi1": dict(moe_fetch_fraction=1.0),
    "cap5-minfill": dict(moe_hybrid_max_fetch=5, moe_min_fill=1),
    "phi0.3-lowest": dict(moe_fetch_fraction=0.3, moe_fill_order="lowest_id"),
}


HOST = DeviceFacts(gpu_missing="no GPU here")


def test_hybrid_cache_may_be_smaller_than_one_step():
    for slots in (1, NEED - 1):
        assert make_plan(model_config(), engine(moe_backend="hybrid", moe_cache_size=slots), HOST).moe.slots == slots


def test_offload_below_one_step_falls_back_to_hybrid_with_a_warning():
    p = make_plan(model_config(), engine(moe_backend="offload", moe_cache_size=2), HOST)
    policy = p.moe.policy
    assert (p.moe.backend, p.moe.slots, policy.kind, policy.cap) == ("hybrid", 2, "cap", E)
    assert policy.count(E) == E                         # every miss, as far as the slots go
    assert len(p.warnings) == 1 and "offload falls back to hybrid" in p.warnings[0]
    assert f"--moe-cache-size >= {NEED} for offload" in p.warnings[0]


def test_a_resize_of_offload_below_one_step_is_refused_naming_the_need():
    start = make_plan(model_config(), engine(moe_backend="offload", moe_cache_size=NEED), HOST)
    with pytest.raises(ConfigError, match=f"offload needs at least {NEED}"):
        resized_plan(model_config(), engine(moe_backend="offload", moe_cache_size=NEED), HOST, start, expert_slots=1)


def test_the_plan_keeps_a_big_enough_offload_and_any_hybrid():
    p = make_plan(model_config(), engine(moe_backend="offload", moe_cache_size=NEED), HOST)
    assert (p.moe.backend, p.moe.slots, p.moe.policy.kind) == ("offload", NEED, "all") and not p.warnings
    p = make_plan(model_config(), engine(moe_backend="hybrid", moe_cache_size=1, moe_fetch_fraction=0.5), HOST)
    assert (p.moe.backend, p.moe.slots, p.moe.policy.kind) == ("hybrid", 1, "fraction")


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(23)
    banks = random_banks(rng, L, E, H, I)
    calls = workload(rng, steps=24, prefill_every=8, prefill_tokens=(3, 6))
    with build_moe(model_config(), banks, planned(engine(moe_backend="fused")), np_experts, lambda m: None) as rt:
        return banks, calls, run(rt, calls)


def check(rt, calls, want, slots):
    for a, b in zip(run(rt, calls), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    s = rt.stats()
    tot = s["total"]
    assert s["backend"] == "hybrid" and s["slots"] == slots
    assert tot["fills"] + tot["cpu_execs"] == tot["misses"] and tot["cpu_execs"] > 0
    for layer in s["layers"]:
        assert layer["fills"] + layer["cpu_execs"] == layer["misses"]


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_host_runtime_matches_fused(setup, slots, policy):
    banks, calls, want = setup
    ec = engine(moe_backend="hybrid", moe_cache_size=slots, **POLICIES[policy])
    with build_moe(model_config(), banks, planned(ec), np_experts, lambda m: None) as rt:
        check(rt, calls, want, slots)


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("policy", ["phi0.3", "cap5-minfill"])
def test_device_runtime_on_host_matches_fused(setup, slots, policy):
    """The discrete-device orchestration (residency, fill plan, staged CPU branch, prefill in
    groups of S) on host arrays (StagingHostDevice)."""
    banks, calls, want = setup
    ec = engine(moe_backend="hybrid", moe_cache_size=slots, **POLICIES[policy])
    with build_moe(model_config(), banks, planned(ec), np_experts, lambda m: None,
                   dev=StagingHostDevice(), cpu_op=np_experts) as rt:
        check(rt, calls, want, slots)


def generate(*args):
    cmd = [sys.executable, "-m", "freetoken", "generate", "--prompt", "def fib(n):", "--max-tokens", "12",
           "--stats", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_cli_one_slot_prints_the_fused_text():
    fused = generate("--moe-backend", "fused")
    hybrid = generate("--moe-backend", "hybrid", "--moe-cache-size", "1")
    assert hybrid.stdout == fused.stdout
    line = next(l for l in hybrid.stderr.splitlines() if "MoE hits" in l)
    n = {k: int(v) for k, v in re.findall(r"(hits|misses|fills|cpu_execs) (\d+)", line)}
    assert n["fills"] + n["cpu_execs"] == n["misses"] and n["cpu_execs"] > 0


# --- on a device (gpu marker; FREETOKEN_CUDA_EMULATE=1 runs them on the emulated device) ---------

@pytest.mark.gpu
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_cuda_runtime_matches_fused(slots):
    """The real residency kernel, fill copies and CPU branch at 1-3 slots, against fused."""
    from freetoken.cupy_loader import cupy as load_cupy
    from freetoken.kernels.experts import cpu as cpu_op
    from freetoken.kernels.experts import gpu as gpu_op
    from freetoken.moe.device import CudaDevice
    from freetoken.moe.host_pool import pin_host_pool
    cp = load_cupy()
    rng = np.random.default_rng(31)
    banks = random_banks(rng, L, E, H, I)
    calls = workload(rng, steps=16, prefill_every=8, prefill_tokens=(3, 6))
    outs = {}
    with pin_host_pool(banks) as host:                  # pinned once, unpinned at the end
        assert host.pinned
        for backend, opts in (("fused", {}), ("hybrid", dict(moe_cache_size=slots, moe_fetch_fraction=0.5))):
            with build_moe(model_config(), host, planned(engine(moe_backend=backend, **opts)), gpu_op, None,
                           dev=CudaDevice(), cpu_op=cpu_op) as rt:
                outs[backend] = [rt.forward(j, cp.asarray(x), cp.asarray(ids), cp.asarray(w),
                                            prefill=p).get() for j, x, ids, w, p in calls]
                stats = rt.stats()
    for a, b in zip(outs["hybrid"], outs["fused"]):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    tot = stats["total"]
    assert stats["device"] == "cuda" and stats["slots"] == slots
    assert tot["fills"] + tot["cpu_execs"] == tot["misses"] and tot["cpu_execs"] > 0


@pytest.mark.gpu
def test_engine_one_slot_gives_the_hf_greedy_tokens():
    from pathlib import Path

    from freetoken import LLM, SamplingParams
    d = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3moe_norm" / "fp32"
    exp = np.load(d / "expected.npz")
    llm = LLM(str(d), backend="cuda", enable_prefix_cache=False, moe_backend="hybrid", moe_cache_size=1,
              moe_fetch_fraction=0.5)
    try:
        out = llm.generate([exp["prompt_ids"].tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        moe = llm.stats()["moe"]
    finally:
        llm.core.close()
    assert moe.get("device") == "cuda" and moe["backend"] == "hybrid" and moe["slots"] == 1
    assert moe["total"]["cpu_execs"] > 0
    assert out.token_ids == exp["greedy_ids"].tolist()
