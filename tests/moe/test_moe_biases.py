"""A model whose experts add biases and take the clamped SwiGLU (gpt-oss) through every MoE backend:
on the host device, and on the staging host device (a discrete device's orchestration on numpy:
the staged CPU branch with host copies of the biases, prefill streamed through the slot pool),
decode and prefill calls over every layer against experts.ref with each layer's biases. The cache
backends call the op on slots: the biases are gathered into rows by slot (MoERuntime._slot_extras),
and hybrid's CPU pairs take them by expert id through the executor thread."""
from dataclasses import replace

import numpy as np
import pytest

from freetoken.kernels import experts
from freetoken.moe.device import HostDevice
from freetoken.moe.runtime import build_moe
from tests.moe.moe_helpers import (E, H, I, K, L, StagingHostDevice, engine, model_config, planned,
                                   random_banks, run, workload)

GLU = (1.702, 7.0)
BACKENDS = {"fused": {}, "cpu": {}, "offload": dict(moe_cache_size=6),
            "hybrid": dict(moe_cache_size=3, moe_fetch_fraction=0.4)}


def biased_model():
    return replace(model_config(), expert_bias=True, swiglu_alpha=GLU[0], swiglu_limit=GLU[1])


def layer_biases(rng):
    return [((rng.standard_normal((E, 2 * I)) * 2).astype(np.float32),
             rng.standard_normal((E, H)).astype(np.float32)) for _ in range(L)]


def ref_op(x, ids, weights, gate_up, down, out=None, **kw):
    return experts.ref(x, ids, weights, gate_up, down, out, **kw)


@pytest.mark.parametrize("device", [HostDevice, StagingHostDevice], ids=["host", "staging"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_adds_each_layers_biases(backend, device):
    rng = np.random.default_rng(len(backend))
    banks, biases = random_banks(rng, L, E, H, I, bf16=False), layer_biases(rng)
    cfg = biased_model()
    plan = planned(engine(moe_backend=backend, **BACKENDS[backend]), cfg=cfg)
    rt = build_moe(cfg, banks, plan, ref_op, dev=device(), cpu_op=ref_op, biases=biases)
    try:
        calls = workload(rng, steps=12, prefill_every=5)
        outs = run(rt, calls)
        for (j, x, ids, w, _), got in zip(calls, outs):
            want = experts.ref(x, ids, w, *banks[j], bias=biases[j], glu=GLU)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        total = rt.stats()["total"]
        if backend in ("offload", "hybrid"):
            assert total["misses"] > 0 and total["hits"] > 0, total
        if backend == "hybrid":
            assert total["cpu_execs"] > 0, total
    finally:
        rt.close()


def test_a_biased_model_needs_its_biases():
    cfg = biased_model()
    plan = planned(engine(moe_backend="fused"), cfg=cfg)
    with pytest.raises(ValueError, match="pass biases="):
        build_moe(cfg, random_banks(np.random.default_rng(0), L, E, H, I), plan, ref_op)
