"""The device MoE runtime on a GPU (gpu marker; bench/gpu_check.sh runs these).

Through the engine: offload, hybrid, cpu and fused give the HF fixtures' greedy tokens on the fp32
checkpoints (top-1 never tied there). On the runtime itself, with the GPU experts op: every backend
matches fused on random workloads, prefill with overlap gives the same outputs as without, and the
slot pool rebuilds in place.
"""
from pathlib import Path

import numpy as np
import pytest
from moe_helpers import E, H, I, L, engine, model_config, planned, random_banks
from moe_helpers import workload as shared_workload

from freetoken.config import EngineConfig
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
CHECKPOINTS = ["qwen3moe_norm", "qwen3moe_nonorm"]
RUNS = {  # fixtures: 3 layers of 8 experts, top-2 or top-3; one step needs at most 4*k <= 8 slots
    "fused": dict(moe_backend="fused"),
    "offload-S8": dict(moe_backend="offload", moe_cache_size=8),
    "offload-S18": dict(moe_backend="offload", moe_cache_size=18),
    "hybrid-phi0.3": dict(moe_backend="hybrid", moe_cache_size=10, moe_fetch_fraction=0.3),
    "hybrid-phi0": dict(moe_backend="hybrid", moe_cache_size=17, moe_fetch_fraction=0.0),
    "hybrid-cap1": dict(moe_backend="hybrid", moe_cache_size=16, moe_hybrid_max_fetch=1),
    "cpu": dict(moe_backend="cpu"),
}


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_tokens_match_hf(name, run):
    from freetoken import LLM, SamplingParams
    exp = np.load(FIXTURES / name / "fp32" / "expected.npz")
    llm = LLM(str(FIXTURES / name / "fp32"), backend="cuda", enable_prefix_cache=False, **RUNS[run])
    try:
        out = llm.generate([exp["prompt_ids"].tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        moe = llm.stats()["moe"]
    finally:
        llm.core.close()
    assert moe.get("device") == "cuda", "the cuda backend must run the MoE runtime over CudaDevice"
    assert moe["backend"] == RUNS[run]["moe_backend"]
    assert out.token_ids == exp["greedy_ids"].tolist()
    if run.startswith("hybrid-phi0.3"):
        assert moe["total"]["cpu_execs"] > 0 and moe["total"]["fills"] > 0


# --- the runtime itself --------------------------------------------------------------------------

def build(backend, banks, host=None, **kw):
    from freetoken.kernels.experts import cpu as cpu_op, gpu as gpu_op
    from freetoken.moe.device import CudaDevice
    from freetoken.moe.runtime import build_moe
    opts = {k: v for k, v in kw.items() if k in EngineConfig.field_names()}
    extra = {k: v for k, v in kw.items() if k not in opts}
    rt = build_moe(model_config(), host if host is not None else banks,
                   planned(engine(moe_backend=backend, **opts)), gpu_op, None,
                   dev=CudaDevice(), cpu_op=cpu_op, **extra)
    return rt


def workload(seed, steps=24, prefill_every=8):
    """Prefill (5-39 tokens) every prefill_every-th step, decode otherwise."""
    return shared_workload(np.random.default_rng(seed), steps, prefill_every, prefill_tokens=(5, 40))


def run(rt, calls):
    cp = load_cupy()
    outs = []
    for j, x, ids, w, prefill in calls:
        dev_ids = cp.asarray(ids)
        outs.append(rt.forward(j, cp.asarray(x), dev_ids, cp.asarray(w), prefill=prefill).get())
        assert (dev_ids.get() == ids).all(), "forward must not modify the caller's ids"
    return outs


@pytest.fixture(scope="module")
def pinned():
    from freetoken.moe.host_pool import pin_host_pool
    banks = random_banks(np.random.default_rng(21), L, E, H, I)
    host = pin_host_pool(banks)
    assert host.pinned
    yield banks, host
    host.close()


@pytest.fixture(scope="module")
def fused_out(pinned):
    banks, host = pinned
    calls = workload(3)
    with build("fused", banks) as rt:
        return calls, run(rt, calls)


@pytest.mark.parametrize("backend,opts", [
    ("offload", dict(moe_cache_size=5)), ("offload", dict(moe_cache_size=20)),
    ("hybrid", dict(moe_cache_size=6, moe_fetch_fraction=0.3)),
    ("hybrid", dict(moe_cache_size=18, moe_fetch_fraction=0.0, handoff="inline")),
    ("hybrid", dict(moe_cache_size=17, moe_hybrid_max_fetch=1, moe_min_fill=1)),
    ("cpu", {})], ids=lambda v: str(v))
def test_backends_match_fused(pinned, fused_out, backend, opts):
    banks, host = pinned
    calls, want = fused_out
    with build(backend, banks, host, **opts) as rt:
        got = run(rt, calls)
        stats = rt.stats()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    tot = stats["total"]
    assert tot["fills"] + tot["cpu_execs"] == tot["misses"] > 0 and stats["device"] == "cuda"


def test_prefill_overlap_gives_the_same_outputs(pinned):
    banks, host = pinned
    calls = [c for c in workload(9) if c[4]] * 2            # repeated chunks, no decode between
    with build("offload", banks, host, moe_cache_size=20) as on:
        assert on.streamer.overlap
        got_on = run(on, calls)
        assert on.streamer.loads == len(calls)
    from freetoken.kernels.experts import cpu as cpu_op, gpu as gpu_op
    from freetoken.moe.device import CudaDevice
    from freetoken.moe.runtime import MoERuntime
    from freetoken.moe.split import FetchPolicy
    with MoERuntime("offload", host, CudaDevice(), gpu_op, cpu_op, num_slots=20,
                       policy=FetchPolicy.fetch_all(), disable_overlap=True) as off:
        assert not off.streamer.overlap
        got_off = run(off, calls)
    for x, y in zip(got_on, got_off):
        np.testing.assert_array_equal(x, y)


def teacher_forced_logits(llm, ids: np.ndarray) -> np.ndarray:
    """f32[T, V] after every position of ids, one prefill forward (host copy of the logits)."""
    from freetoken.models.forward_batch import ForwardBatch
    core, T = llm.core, len(ids)
    slots = np.asarray(core.kv.alloc(T), dtype=np.int32)
    try:
        batch = ForwardBatch(ids=ids.astype(np.int32), positions=np.arange(T, dtype=np.int32),
                             tok_seq=np.zeros(T, np.int32), slots=slots, slot_table=slots[None, :],
                             last_index=np.arange(T, dtype=np.int32), prefill=True)
        return core.ops.to_host(core.model.forward(batch))
    finally:
        core.kv.free(slots.tolist())


def test_prefill_overlap_same_logits_through_the_engine():
    from freetoken import LLM
    d = FIXTURES / "qwen3moe_norm" / "fp32"
    exp = np.load(d / "expected.npz")
    ids = np.concatenate([exp["prompt_ids"], exp["greedy_ids"][:-1]])
    logits = []
    for disabled in (False, True):
        llm = LLM(str(d), backend="cuda", moe_backend="offload", moe_cache_size=20,
                  moe_prefill_overlap=not disabled)
        try:
            logits.append(teacher_forced_logits(llm, ids))
        finally:
            llm.core.close()
    np.testing.assert_array_equal(logits[0], logits[1])


def test_slot_pool_rebuild_on_gpu(pinned, fused_out):
    banks, host = pinned
    calls, want = fused_out
    with build("hybrid", banks, host, moe_cache_size=6, moe_fetch_fraction=0.3) as rt:
        run(rt, calls[:12])
        rt.rebuild(20)
        assert rt.pool[0].shape[0] == 20 and rt.streamer.overlap and rt.stats()["total"]["hits"] == 0
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
        rt.rebuild(7)
        assert rt.pool[0].shape[0] == 7 and not rt.streamer.overlap
        for a, b in zip(run(rt, calls), want):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
