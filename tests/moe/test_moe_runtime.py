"""build_moe / MoERuntime on the host device (the CPU engine's): every backend computes the same layer
outputs; sizing and policy rules; the host specialisations (prefill and fused read the host bank in
place, the cpu backend runs inline, hybrid overlaps the CPU overflow on the executor thread)."""
import threading

import numpy as np
import pytest
from moe_helpers import (E, H, I, L, build, engine, model_config, np_experts, planned, random_banks, run,
                         workload)

from freetoken.config import ConfigError
from freetoken.moe.runtime import build_moe

VARIANTS = {
    "offload": dict(moe_cache_size=5),
    "cpu": {},
    "hybrid-phi0": dict(moe_cache_size=5, moe_fetch_fraction=0.0),
    "hybrid-phi0.3": dict(moe_cache_size=6, moe_fetch_fraction=0.3),
    "hybrid-phi1": dict(moe_cache_size=4, moe_fetch_fraction=1.0),
    "hybrid-cap2": dict(moe_cache_size=7, moe_hybrid_max_fetch=2),
    "hybrid-phi0.3-minfill": dict(moe_cache_size=5, moe_fetch_fraction=0.3, moe_min_fill=1),
}


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(7)
    banks = random_banks(rng, L, E, H, I)
    calls = workload(rng)
    with build("fused", banks) as rt:
        return banks, calls, run(rt, calls)


@pytest.mark.parametrize("name", VARIANTS)
def test_backends_match_fused(setup, name):
    banks, calls, want = setup
    with build(name.split("-")[0], banks, **VARIANTS[name]) as rt:
        got = run(rt, calls)
        tot = rt.stats()["total"]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert tot["hits"] + tot["misses"] > 0
    assert tot["fills"] + tot["cpu_execs"] == tot["misses"]
    if name in ("hybrid-phi0.3", "hybrid-cap2", "hybrid-phi0.3-minfill"):
        assert tot["fills"] > 0 and tot["cpu_execs"] > 0, "both branches must be exercised"


def test_hybrid_with_the_numba_kernel(setup):
    """The real cpu experts op on the executor thread and on the caller at the same time."""
    from freetoken.kernels import experts
    banks, calls, want = setup
    ec = engine(moe_backend="hybrid", moe_cache_size=6, moe_fetch_fraction=0.3, moe_cpu_threads=1)
    with build_moe(model_config(), banks, planned(ec), experts.cpu, lambda m: None) as rt:
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_phi0_never_fills_and_phi1_never_runs_a_miss_on_cpu(setup):
    banks, calls, _ = setup
    with build("hybrid", banks, moe_cache_size=5, moe_fetch_fraction=0.0) as rt:
        for j, x, ids, w, prefill in calls:
            rt.forward(j, x, ids, w, prefill)
            assert rt.stats()["total"]["fills"] == 0
        assert rt.stats()["total"]["cpu_execs"] > 0
    with build("hybrid", banks, moe_cache_size=4, moe_fetch_fraction=1.0) as rt:
        for j, x, ids, w, prefill in calls:
            rt.forward(j, x, ids, w, prefill)
            assert rt.stats()["total"]["cpu_execs"] == 0
        assert rt.stats()["total"]["fills"] > 0


def test_offload_fills_every_miss_and_prefill_leaves_residency_alone(setup):
    banks, calls, _ = setup
    with build("offload", banks, moe_cache_size=5) as rt:
        j, x, ids, w, _ = calls[0]
        rt.forward(j, x, ids, w, prefill=True)
        assert rt.res.snapshot()["clock"] == 0 and rt.stats()["prefill_calls"] == 1
        run(rt, calls[L:])
        s = rt.stats()
        assert s["total"]["fills"] == s["total"]["misses"] and s["total"]["cpu_execs"] == 0
        assert len(s["layers"]) == L and s["slots"] == 5
        assert sum(layer["hits"] for layer in s["layers"]) == s["total"]["hits"]
        rt.reset()
        assert rt.res.snapshot()["clock"] == 0 and rt.stats()["total"]["misses"] == 0


def test_cache_sizing_rules():
    banks = random_banks(np.random.default_rng(0), L, E, H, I)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        build("hybrid", banks, moe_cache_size=8, moe_cache_rate=0.5)
    logs = []                                               # below one step's need of 4
    with build("offload", banks, logs, moe_cache_size=3) as rt:
        assert (rt.backend, rt.num_slots, rt.policy.kind, rt.policy.cap) == ("hybrid", 3, "cap", E)
        assert rt.branch is not None                        # the misses without a slot: the CPU
    assert any(m.startswith("WARN") and "offload falls back to hybrid" in m for m in logs)
    with build("offload", banks, moe_cache_rate=0.25) as rt:
        assert rt.num_slots == 6                              # ceil(0.25 * 24)
    with build("offload", banks) as rt:
        assert rt.num_slots == 6                              # default 25% of L*E
    with build("offload", banks, moe_cache_size=1000) as rt:
        assert rt.num_slots == L * E


def test_rate_rounding_is_not_fooled_by_floats():
    cfg = model_config(layers=10, experts=10)
    banks = random_banks(np.random.default_rng(0), 10, 10, H, I)
    rt = build_moe(cfg, banks, planned(engine(moe_backend="offload", moe_cache_rate=0.1), cfg=cfg), np_experts, print)
    assert rt.num_slots == 10                                 # 0.1 * 100 in floats is 10.000000000000002


def test_auto_and_fallback_are_logged():
    banks = random_banks(np.random.default_rng(0), L, E, H, I)
    logs = []
    with build("auto", banks, logs) as rt:
        assert rt.backend == "cpu"
    assert any(m.startswith("moe backend cpu (auto: no GPU") for m in logs)
    logs.clear()
    with build("hybrid", banks, logs, moe_cache_size=6) as rt:
        assert rt.policy.kind == "cap" and rt.policy.cap == 1
    assert any(m.startswith("WARN") and "fixed cap of 1" in m for m in logs)


def test_policy_precedence():
    banks = random_banks(np.random.default_rng(0), L, E, H, I)
    with build("hybrid", banks, moe_hybrid_max_fetch=3, moe_fetch_fraction=0.5) as rt:
        assert (rt.policy.kind, rt.policy.cap) == ("cap", 3)
    with build("hybrid", banks, moe_fetch_fraction=0.5, moe_min_fill=1) as rt:
        assert (rt.policy.kind, rt.policy.frac_q16, rt.policy.min_fill) == ("fraction", 32768, 1)
    rt = build_moe(model_config(), banks, planned(engine(moe_backend="hybrid"), phi=0.25), np_experts, print)
    assert (rt.policy.kind, rt.policy.frac_q16) == ("fraction", 16384)
    rt.close()


def test_bad_banks_are_rejected():
    banks = random_banks(np.random.default_rng(0), L, E, H, I)
    with pytest.raises(ConfigError, match="2 expert banks for 3 MoE layers"):
        build("fused", banks[:2])
    with pytest.raises(ValueError, match="expected gate_up"):
        build("fused", [(b[0][:, :4], b[1]) for b in banks])


def test_close_joins_executor_threads():
    banks = random_banks(np.random.default_rng(0), L, E, H, I)
    before = set(threading.enumerate())
    for name in ("cpu", "hybrid"):
        rt = build(name, banks, moe_fetch_fraction=0.3)
        rt.close()
        rt.close()
    assert set(threading.enumerate()) == before


def test_short_prefill_runs_through_the_cache_like_decode():
    """--moe-prefill-decode-tokens: a short chunk uses the residency step (and counts as decode);
    a long one, or one whose distinct experts exceed the slots, streams like any prefill."""
    rng = np.random.default_rng(5)
    cfg = model_config()
    banks = random_banks(rng, len(cfg.moe_layers), cfg.num_experts, cfg.hidden_size,
                         cfg.moe_intermediate_size)
    ec = engine(moe_backend="offload", moe_cache_size=cfg.num_experts, moe_prefill_decode_tokens=4)
    with build_moe(cfg, banks, planned(ec, cfg=cfg), np_experts, lambda m: None) as rt:
        x = rng.standard_normal((3, cfg.hidden_size), dtype=np.float32)
        ids = np.zeros((3, cfg.num_experts_per_tok), np.int32)
        ids[:, :] = np.arange(cfg.num_experts_per_tok)
        w = np.full(ids.shape, 0.5, np.float32)
        want = np_experts(x, ids, w, banks[0][0], banks[0][1])
        np.testing.assert_allclose(rt.forward(0, x, ids, w, prefill=True), want, rtol=1e-5, atol=1e-6)
        assert rt.stats()["prefill_calls"] == 0 and rt.stats()["total"]["misses"] > 0
        long_x = np.repeat(x, 2, axis=0)
        rt.forward(0, long_x, np.repeat(ids, 2, axis=0), np.repeat(w, 2, axis=0), prefill=True)
        assert rt.stats()["prefill_calls"] == 1


def recording_op(seen):
    """np_experts that records (thread id, whether it read a layer's host bank in place) per call."""
    def op(x, ids, weights, gate_up, down, out=None):
        seen.append((threading.get_ident(), gate_up.shape[0] == E and not gate_up.flags.owndata))
        return np_experts(x, ids, weights, gate_up, down, out)
    return op


def test_host_specialisations(setup):
    """cpu: the kernel inline on the caller's thread, no executor thread. hybrid: the CPU overflow on
    the executor thread. Prefill of every backend: the layer's host bank, in place (no streaming)."""
    banks, calls, want = setup
    views = [(gu[:], dn[:]) for gu, dn in banks]        # views: a copy would own its data
    me = threading.get_ident()
    for name, opts in (("cpu", {}), ("hybrid", VARIANTS["hybrid-phi0.3"]), ("offload", VARIANTS["offload"])):
        seen, before = [], threading.active_count()
        ec = engine(moe_backend=name, **opts)
        with build_moe(model_config(), views, planned(ec), recording_op(seen), lambda m: None) as rt:
            got = run(rt, calls)
            assert rt.streamer is None and rt.stats()["prefill_overlap"] is False
            if name == "cpu":
                assert threading.active_count() == before and rt.pool is None
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        prefill_calls = sum(c[4] for c in calls)
        assert sum(in_place for _, in_place in seen) >= prefill_calls
        threads = {t for t, _ in seen}
        if name == "hybrid":
            assert me in threads and len(threads) == 2, "the overflow runs on the executor thread"
        else:
            assert threads == {me}


def test_rebuild_on_host(setup):
    banks, calls, want = setup
    with build("hybrid", banks, **VARIANTS["hybrid-phi0.3"]) as rt:
        run(rt, calls[:9])
        before = rt.stats()
        assert before["total"]["misses"] and before["cpu_calls"]
        rt.rebuild(20)
        assert rt.num_slots == 20 and rt.pool[0].shape[0] == 20
        after = rt.stats()                              # the docstring's "zero counters", every one
        assert after["total"]["hits"] == after["total"]["misses"] == after["prefill_calls"] == after["cpu_calls"] == after["prefill_loads"] == 0
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with build("fused", banks) as rt, pytest.raises(AssertionError):   # the plan refuses it first
        rt.rebuild(10)
