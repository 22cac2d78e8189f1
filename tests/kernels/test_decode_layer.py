"""kernels/decode_layer.py through the engine: the attention half of a decode layer in one numba
call gives what the ops composed give, bit for bit (greedy tokens and their logprobs), for every
kind of attention weight a Qwen3-MoE checkpoint brings (bf16 rows, f32 rows, a GGUF's quantized
linears, its q|k and v parts of two formats), at batch 1 and 2, with f32 and bf16 KV; it is
taken at decode and only there; bad slots raise the ops' errors and write nothing."""
import types
from pathlib import Path

import numpy as np
import pytest

from freetoken import LLM, SamplingParams
from freetoken.kernels import decode_layer, decode_stack

GGUF = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88], [5, 6, 7]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
CASES = {   # name -> (model, engine options)
    "bf16 rows, bf16 KV": ("synth:tiny", {"kv_dtype": "bfloat16"}),
    "f32 rows, f32 KV": (str(GGUF / "qwen3moe_norm-f32.gguf"), {"kv_dtype": "float32"}),
    "q4_k and a q|k + v pair": (str(GGUF / "qwen3moe_256-q4_k_m.gguf"), {}),
    "q8_0, f32 dots": (str(GGUF / "qwen3moe_256-mxfp4_moe.gguf"), {"cpu_dots": "f32"}),
    "q4_0 experts interleaved": (str(GGUF / "qwen3moe_256-q4_0.gguf"), {}),   # where there is VNNI (kernels/qinterleave.py)
}


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts decode_layer.cpu's one-call layers (n) and those of them that added the routed
    experts too (experts); the engine's ops bind decode_layer.cpu when the LLM is made."""
    calls = types.SimpleNamespace(n=0, experts=0)
    plain = decode_layer.cpu

    def counted(*args, **kwargs):
        out = plain(*args, **kwargs)
        calls.n += out is not None
        calls.experts += out is not None and out[2]
        return out
    monkeypatch.setattr(decode_layer, "cpu", counted)
    return calls


def _generate(model, fused, options, prompts=PROMPTS):
    llm = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=fused, **options)
    outs = llm.generate(prompts, PARAMS)
    return [(o.token_ids, [(lp.token, lp.logprob, lp.top) for lp in o.logprobs])
            for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_one_call_a_layer_gives_the_composed_ops_bit_for_bit(case, fused_calls):
    model, options = CASES[case]
    composed = _generate(model, False, options)
    assert fused_calls.n == 0
    fused = _generate(model, True, options)
    assert fused == composed
    assert fused_calls.n > 0


@pytest.mark.parametrize("case", ["q4_k and a q|k + v pair", "q8_0, f32 dots", "bf16 rows, bf16 KV",
                                  "q4_0 experts interleaved"])
def test_batch_1_with_the_experts_in_the_call_equals_the_composed_ops(case, fused_calls, monkeypatch):
    """At one token a step a quantized bank's routed experts run in the layer's call too (the MoE
    runtime's cpu backend hands over its host bank; bf16-pair rows too): the same tokens and logprobs, bit for bit,
    and the runtime's counters as when it ran them. (Every layer in one call, kernels/decode_stack.py,
    takes such steps first; declined here, as for a model it does not take.)"""
    monkeypatch.setattr(decode_stack, "cpu", lambda *args, **kwargs: None)
    model, options = CASES[case]
    composed = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=False, **options)
    fused = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=True, **options)
    outs = [llm.generate(PROMPTS[:1], PARAMS)[0] for llm in (composed, fused)]
    assert outs[0].token_ids == outs[1].token_ids
    assert [(lp.token, lp.logprob, lp.top) for lp in outs[0].logprobs] == \
        [(lp.token, lp.logprob, lp.top) for lp in outs[1].logprobs]
    assert fused_calls.experts == fused_calls.n > 0
    moe = [llm.core.model.moe for llm in (composed, fused)]
    assert np.array_equal(moe[0].res.counters_host(), moe[1].res.counters_host())
    assert moe[0].branch.calls == moe[1].branch.calls


def test_prefill_and_wide_steps_are_composed():
    """A prefill step, and a decode step of FUSED_MAX_T tokens (its linears are BLAS or the
    tile GEMM, not the GEMVs the kernel calls), return None: the model composes the ops."""
    llm = LLM("synth:tiny", backend="cpu")
    lw, (k_cache, v_cache) = llm.core.weights.layers[0], llm.core.kv.layer(0)
    H = llm.core.model_config.hidden_size
    for T, prefill in ((4, True), (decode_layer.FUSED_MAX_T, False)):
        batch = _batch(T, prefill)
        assert llm.core.ops.decode_layer(np.zeros((T, H), np.float32), lw, k_cache, v_cache, batch,
                                         llm.core.model.inv_freq, 1e-6, 0.25, (4, 2, 16)) is None


def _batch(T, prefill, slots=None, table=None):
    from freetoken.models.forward_batch import ForwardBatch
    positions = np.zeros(T, np.int32)
    return ForwardBatch(ids=np.zeros(T, np.int32), positions=positions, tok_seq=np.arange(T, dtype=np.int32),
                        slots=np.arange(T, dtype=np.int32) if slots is None else slots,
                        slot_table=np.arange(T, dtype=np.int32)[:, None] if table is None else table,
                        last_index=np.arange(T, dtype=np.int32), prefill=prefill)


@pytest.mark.parametrize("slots, table, message", [
    (np.array([10**6], np.int32), None, "kv_write: slot 1000000 out of range"),
    (None, np.array([[-3]], np.int32), "attention: sequence 0 reads a slot outside"),
])
def test_bad_slots_raise_the_ops_errors_and_leave_x_alone(slots, table, message):
    llm = LLM("synth:tiny", backend="cpu")
    cfg, lw, (k_cache, v_cache) = llm.core.model_config, llm.core.weights.layers[0], llm.core.kv.layer(0)
    x = np.ones((1, cfg.hidden_size), np.float32)
    before = k_cache.copy()
    with pytest.raises(IndexError, match=message):
        llm.core.ops.decode_layer(x, lw, k_cache, v_cache, _batch(1, False, slots, table), llm.core.model.inv_freq,
                                  cfg.rms_norm_eps, cfg.head_dim ** -0.5,
                                  (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    assert (x == 1).all() and np.array_equal(k_cache, before)
