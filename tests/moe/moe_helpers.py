"""Shared test helpers: a small numpy `experts` op (the contract in docs/contracts.md) and banks.

Shape legend: T tokens, H hidden, E experts, k routed, I expert width, S slots.
"""
import numpy as np

from freetoken.config import EngineConfig
from freetoken.models.hf_config import model_config_from_dict
from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.moe.device import HostDevice
from freetoken.moe.runtime import build_moe


class StagingHostDevice(HostDevice):
    """The host device without its one capability (host_memory): the runtime then runs a discrete
    device's orchestration on numpy arrays (staged CPU branch, prefill streamed through the slot
    pool), so CI checks that code without a GPU."""

    host_memory = False
    name = "host-staging"


def np_experts(x, ids, weights, gate_up, down, out=None):
    """out[t] = sum_j w[t,j] * down[ids[t,j]] @ (silu(g) * u); ids < 0 contribute nothing."""
    T, H = x.shape
    out = np.zeros((T, H), np.float32) if out is None else out
    out[...] = 0.0
    inter = gate_up.shape[1] // 2
    for t in range(T):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            gu = to_f32(gate_up[e]) @ x[t]
            g, u = gu[:inter], gu[inter:]
            act = g / (1.0 + np.exp(-g)) * u
            out[t] += weights[t, j] * (to_f32(down[e]) @ act)
    return out


def random_banks(rng, layers, experts, hidden, width, bf16=True):
    """One (gate_up [E,2I,H], down [E,H,I]) pair per layer, small values, bf16 or f32."""
    banks = []
    for _ in range(layers):
        gu = rng.standard_normal((experts, 2 * width, hidden), np.float32) * 0.2
        dn = rng.standard_normal((experts, hidden, width), np.float32) * 0.2
        banks.append((from_f32(gu), from_f32(dn)) if bf16 else (gu, dn))
    return banks


def random_routing(rng, tokens, experts, top_k):
    """ids int32[T,k] (distinct per row) and weights f32[T,k] summing to 1 per row."""
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, top_k)).astype(np.float32) + 0.1
    return ids, (w / w.sum(1, keepdims=True)).astype(np.float32)


# A small model for runtime tests: L MoE layers of E experts, top-K, hidden H, expert width I.
L, E, K, H, I = 3, 8, 2, 16, 8


def model_config(layers=L, experts=E, top_k=K):
    return model_config_from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": H,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "num_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": I, "norm_topk_prob": True})


def engine(**kw):
    # Prefill streams whole layers in these tests unless a test asks for the short-chunk path.
    return EngineConfig(**{"max_running_requests": 2, "moe_prefill_decode_tokens": 0, **kw})


def planned(ec, phi=None, cfg=None, log=None):
    """The MoE part of the start-up plan (engine/plan.py) for these flags on a machine without a
    GPU; phi: a bandwidth profile with that fetch fraction (B_P / B_H). log: a callable that gets
    each decision (and "WARN " + each warning), as the engine's start-up log does."""
    from freetoken.engine.plan import DeviceFacts, make_plan
    from freetoken.moe.profile import Profile
    profile = None if phi is None else Profile("GPU-test", "test", "bf16", 1, b_h_gbs=1.0, b_p_gbs=phi)
    plan = make_plan(cfg or model_config(), ec, DeviceFacts(gpu_missing="no GPU in this test", profile=profile))
    for d in plan.decisions if log else ():
        log(f"{d.name} {d.value} ({d.why})")
    for line in plan.warnings if log else ():
        log(f"WARN {line}")
    return plan.moe


def build(backend, banks, logs=None, **kw):
    sink = logs.append if logs is not None else (lambda msg: None)
    return build_moe(model_config(), banks, planned(engine(moe_backend=backend, **kw), log=sink), np_experts,
                     sink)


def workload(rng, steps=40, prefill_every=0, prefill_tokens=(5, 6)):
    """(j, x, ids, weights, prefill) calls over every layer: prefill steps (step 0, and every
    prefill_every-th when > 0) of prefill_tokens[0]..prefill_tokens[1]-1 tokens, else decode
    steps of 1-2 tokens."""
    calls = []
    for step in range(steps):
        prefill = step == 0 or (prefill_every > 0 and step % prefill_every == 0)
        T = int(rng.integers(*prefill_tokens)) if prefill else int(rng.integers(1, 3))
        for j in range(L):
            ids, w = random_routing(rng, T, E, K)
            calls.append((j, rng.standard_normal((T, H), np.float32), ids, w, prefill))
    return calls


def run(rt, calls):
    """Outputs of rt.forward over calls; checks forward never modifies the caller's ids."""
    outs = []
    for j, x, ids, w, prefill in calls:
        before = ids.copy()
        outs.append(rt.forward(j, x, ids, w, prefill=prefill))
        assert np.array_equal(ids, before), "forward must not modify the caller's ids"
    return outs
