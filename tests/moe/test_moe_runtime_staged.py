"""The MoE runtime's discrete-device orchestration (the one CudaDevice gets: staged CPU branch,
prefill streamed through the slot pool, fill plan on the copy stream, rebuild) on numpy arrays,
through StagingHostDevice (moe_helpers), checked in CI against the runtime on the host device
(which reads the host bank in place) and the fused backend."""
import numpy as np
import pytest
from moe_helpers import (E, H, I, L, StagingHostDevice, engine, model_config, np_experts, planned,
                         random_banks, run)
from moe_helpers import workload as _workload

from freetoken.moe.cpu_branch import measure_handoff
from freetoken.moe.device import HostDevice
from freetoken.moe.host_pool import HostPool
from freetoken.moe.runtime import MoERuntime, build_moe
from freetoken.moe.split import FetchPolicy


def workload(rng):
    """Prefill (3-6 tokens) every 10th step, decode otherwise."""
    return _workload(rng, steps=30, prefill_every=10, prefill_tokens=(3, 7))


VARIANTS = {
    "offload-small": ("offload", dict(moe_cache_size=5)),      # S < E: prefill in groups
    "offload-mid": ("offload", dict(moe_cache_size=11)),       # E <= S < 2E: one group
    "offload-big": ("offload", dict(moe_cache_size=20)),       # S >= 2E: double buffering
    "hybrid-phi0.3": ("hybrid", dict(moe_cache_size=6, moe_fetch_fraction=0.3)),
    "hybrid-phi0-big": ("hybrid", dict(moe_cache_size=17, moe_fetch_fraction=0.0)),
    "hybrid-cap1": ("hybrid", dict(moe_cache_size=18, moe_hybrid_max_fetch=1, moe_min_fill=1)),
    "cpu": ("cpu", {}),
    "fused": ("fused", {}),
}


def build(name, banks, logs=None, **kw):
    backend, opts = VARIANTS[name]
    sink = logs.append if logs is not None else (lambda m: None)
    return build_moe(model_config(), banks, planned(engine(moe_backend=backend, **opts)), np_experts,
                     sink, dev=StagingHostDevice(), cpu_op=np_experts, **kw)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(11)
    banks = random_banks(rng, L, E, H, I)
    calls = workload(rng)
    with build_moe(model_config(), banks, planned(engine(moe_backend="fused")), np_experts, lambda m: None) as rt:
        return banks, calls, run(rt, calls)


@pytest.mark.parametrize("handoff", ["thread", "inline"])
@pytest.mark.parametrize("name", VARIANTS)
def test_matches_fused(setup, name, handoff):
    banks, calls, want = setup
    with build(name, banks, handoff=handoff) as rt:
        got = run(rt, calls)
        stats = rt.stats()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    tot = stats["total"]
    assert tot["fills"] + tot["cpu_execs"] == tot["misses"] and tot["hits"] + tot["misses"] > 0
    assert stats["prefill_calls"] == 3 * L
    assert stats["prefill_overlap"] == (name in ("offload-big", "hybrid-phi0-big", "hybrid-cap1", "cpu"))


@pytest.mark.parametrize("name", ["offload-mid", "hybrid-phi0.3", "hybrid-cap1"])
def test_decode_counters_match_host_runtime(setup, name):
    """Without prefill, staged and in place give the same counters (the residency is the spec's)."""
    banks, calls, _ = setup
    decode = [c for c in calls if not c[4]]
    backend, opts = VARIANTS[name]
    with build(name, banks) as rt, build_moe(model_config(), banks, planned(engine(moe_backend=backend, **opts)),
                                             np_experts, lambda m: None) as ref:
        run(rt, decode)
        run(ref, decode)
        assert rt.stats()["total"] == ref.stats()["total"]


def test_prefill_borrows_and_invalidates_slots(setup):
    banks, calls, _ = setup
    with build("offload-big", banks) as rt:
        run(rt, [c for c in calls if not c[4]][:12])
        snap = rt.res.snapshot()
        assert (snap["owner_of"][:2 * E] >= 0).any()
        j, x, ids, w, _ = calls[0]
        rt.forward(0, x, ids, w, prefill=True)
        snap = rt.res.snapshot()
        assert (snap["owner_of"][:2 * E] == -1).all() and (snap["usage"][:2 * E] == 0).all()
        assert not ((snap["slot_for"] >= 0) & (snap["slot_for"] < 2 * E)).any()
        assert rt.streamer.loads == 2              # layer 0 and, ahead of time, layer 1


def test_prefill_copies_resident_experts_device_to_device(setup):
    banks, calls, _ = setup
    with build("offload-big", banks) as rt:
        rt.res.step(1, np.array([[2, 5]], np.int32), np.empty((1, 2), np.int32), FetchPolicy.fetch_all())
        rt.res.invalidate(0, 2 * E)
        rt.res.cache.slot_for[1, 5] = 19           # pretend expert 5 of layer 1 lives in slot 19
        rt.res.cache.owner_of[19] = 1 * E + 5
        rt.pool[0][19] = 12345
        rt.streamer._begin = lambda: None           # keep the hand-made residency as it is
        rt.streamer._prefetch(1)
        assert (rt.pool[0][E + 5] == 12345).all()   # buffer 1, position 5: from the slot
        np.testing.assert_array_equal(rt.pool[0][E + 2], banks[1][0][2])   # from the host pool


def test_disabled_overlap_and_small_cache_are_logged(setup):
    banks, calls, want = setup
    logs = []
    with build("offload-big", banks, logs) as rt:
        assert rt.streamer.overlap and not any("WARN" in m for m in logs)
    host = HostPool.pageable(banks)
    with MoERuntime("offload", host, StagingHostDevice(), np_experts, np_experts,
                       policy=FetchPolicy.fetch_all(), num_slots=20, disable_overlap=True,
                       log=logs.append) as rt:
        assert not rt.streamer.overlap
        assert any("overlap disabled" in m for m in logs)
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    build("offload-small", banks, logs).close()
    assert any(m.startswith("WARN") and "2E = 16" in m for m in logs)


def test_rebuild_resizes_and_starts_cold(setup):
    banks, calls, want = setup
    logs = []
    with build("hybrid-phi0.3", banks, logs) as rt:
        run(rt, calls[:9])
        rt.rebuild(20)
        assert rt.num_slots == 20 and rt.pool[0].shape[0] == 20 and rt.streamer.overlap
        assert rt.stats()["total"]["hits"] == 0 and rt.stats()["prefill_calls"] == 0
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with build("cpu", banks) as rt, pytest.raises(AssertionError):   # the plan refuses it first
        rt.rebuild(10)


class NeedsPinning(StagingHostDevice):
    needs_pinning = True


def test_an_unpinned_pool_is_refused_and_the_plan_again_runs_cpu(setup):
    """A device that needs pinned memory, and pinning fails (no GPU here): a WARN, build_moe refuses
    a cached backend over the pageable pool, and the plan made again with the failure known runs
    the cpu backend (EngineCore._make_moe does exactly this), with the same output."""
    from freetoken.engine.plan import DeviceFacts, make_plan
    from freetoken.moe.runtime import host_pool_for
    banks, calls, want = setup
    ec, logs = engine(moe_backend="hybrid", moe_cache_size=6), []
    host = host_pool_for(model_config(), banks, planned(ec), NeedsPinning(), logs.append)
    assert not host.pinned and any(m.startswith("WARN") and "pinning the host expert pool" in m for m in logs)
    with pytest.raises(ValueError, match="needs a pinned host expert pool"):
        build_moe(model_config(), host, planned(ec), np_experts, dev=NeedsPinning())
    again = make_plan(model_config(), ec, DeviceFacts(gpu_missing=None, free_device_bytes=1 << 40, host_pinned=False))
    assert again.moe.backend == "cpu" and any("pinning it failed" in w for w in again.warnings)
    with build_moe(model_config(), host, again.moe, np_experts, dev=NeedsPinning(), cpu_op=np_experts) as rt:
        assert rt.backend == "cpu" and not rt.host.pinned and rt.streamer is None
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bank_errors_come_before_pinning(setup):
    banks, _, _ = setup
    with pytest.raises(ValueError, match="expert banks"):
        build_moe(model_config(), banks[:2], planned(engine(moe_backend="cpu")), np_experts, dev=StagingHostDevice())


def test_measure_handoff_on_host():
    r = measure_handoff(HostDevice(), tokens=1, hidden=64, top_k=4, iters=30)
    assert r["device"] == "host"
    for mode in ("thread", "inline"):
        parts = r[mode]
        assert set(parts) == {"stage_us", "handoff_us", "merge_us", "total_us"}
        assert all(v >= 0 for v in parts.values())
    assert r["inline"]["handoff_us"] <= r["thread"]["handoff_us"] + 50


@pytest.mark.parametrize("options", [
    dict(moe_backend="offload", moe_cache_size=40),            # S >= 2E: prefill double-buffered
    dict(moe_backend="offload", moe_cache_size=20),
    dict(moe_backend="hybrid", moe_cache_size=40, moe_fetch_fraction=0.3),
    dict(moe_backend="cpu"),
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_engine_with_the_staged_runtime_gives_the_same_text(monkeypatch, options):
    """The demo model through EngineCore with _make_moe swapped for the runtime on the staging host
    device (the orchestration the cuda backend gets): same greedy tokens as the cpu backend on the
    host device, and the runtime saw prefill and decode calls."""
    from freetoken.engine.core import EngineCore
    from freetoken.engine.llm import LLM
    from freetoken.engine.request import SamplingParams
    from freetoken.kernels.experts import cpu as cpu_experts

    def make_device_moe(core):
        cfg = core.model_config
        banks = [(core.weights.layers[i].gate_up, core.weights.layers[i].down) for i in cfg.moe_layers]
        return build_moe(cfg, banks, core.plan.moe, core.ops.experts, None, dev=StagingHostDevice(),
                         cpu_op=cpu_experts)

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = list(range(5, 40))
    ref = LLM(backend="cpu", moe_backend="cpu", enable_prefix_cache=False)
    want = ref.generate(prompt, params)[0].token_ids
    ref.core.close()
    monkeypatch.setattr(EngineCore, "_make_moe", make_device_moe)
    llm = LLM(backend="cpu", enable_prefix_cache=False, **options)
    try:
        assert llm.core.moe.dev.name == StagingHostDevice.name
        assert llm.generate(prompt, params)[0].token_ids == want
        stats = llm.stats()["moe"]
        assert stats["prefill_calls"] > 0 and stats["total"]["hits"] + stats["total"]["misses"] > 0
        assert stats["prefill_overlap"] == (options.get("moe_cache_size", 0) >= 32 or options["moe_backend"] == "cpu")
    finally:
        llm.core.close()
