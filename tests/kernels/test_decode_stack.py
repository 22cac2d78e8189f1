"""kernels/decode_stack.py through the engine: every layer of a one-token decode step in one
numba call gives what the ops composed give, bit for bit (greedy tokens, their logprobs, the MoE
runtime's counters), for each kind of weights test_decode_layer.py covers (a GGUF whose qkv is one
array on some layers and two parts on others included); steps of two sequences and prefill go
layer by layer; bad slots raise the ops' errors and write nothing."""
import types

import numpy as np
import pytest

from freetoken import LLM
from freetoken.kernels import decode_stack
from test_decode_layer import CASES, PARAMS, PROMPTS, _batch


@pytest.fixture
def stack_calls(monkeypatch):
    """Counts decode_stack.cpu's calls (n) and those that ran the layers (taken)."""
    calls = types.SimpleNamespace(n=0, taken=0)
    plain = decode_stack.cpu

    def counted(*args, **kwargs):
        out = plain(*args, **kwargs)
        calls.n += 1
        calls.taken += out is not None
        return out
    monkeypatch.setattr(decode_stack, "cpu", counted)
    return calls


def _outputs(llm, prompts):
    return [(o.token_ids, [(lp.token, lp.logprob, lp.top) for lp in o.logprobs]) for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_layer_in_one_call_gives_the_composed_ops_bit_for_bit(case, stack_calls):
    """Taken at every decode step where the one-layer call would add the experts too (an f32
    bank's experts it does not take: declined there, and the same outputs)."""
    model, options = CASES[case]
    composed = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=False, **options)
    assert stack_calls.n == 0
    stacked = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=True, **options)
    stack_calls.taken = 0                                      # the engine's warm-up step
    assert _outputs(stacked, PROMPTS[:1]) == _outputs(composed, PROMPTS[:1])
    steps = PARAMS.max_tokens - 1                              # every decode step, no prefill
    assert stack_calls.taken == (0 if case == "f32 rows, f32 KV" else steps)
    moe = [llm.core.model.moe for llm in (composed, stacked)]
    assert np.array_equal(moe[0].res.counters_host(), moe[1].res.counters_host())
    assert moe[0].branch.calls == moe[1].branch.calls


def test_two_sequences_go_layer_by_layer():
    """A step of two sequences (two tokens) is declined, and the one-layer calls run it: two
    prompts decode as the composed ops do."""
    model, options = CASES["q4_k and a q|k + v pair"]
    composed = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=False, **options)
    stacked = LLM(model, backend="cpu", moe_backend="cpu", cpu_decode_layer=True, **options)
    assert _outputs(stacked, PROMPTS) == _outputs(composed, PROMPTS)
    assert _stack_call(stacked, np.zeros((2, stacked.core.model_config.hidden_size), np.float32),
                       _batch(2, False)) is None


def _stack_call(llm, x, batch):
    core, cfg = llm.core, llm.core.model_config
    banks = [core.model.moe.inline_bank(j, False) for j in range(len(core.weights.layers))]
    return core.ops.decode_stack(x, core.weights.layers, core.kv, banks, batch, core.model.inv_freq,
                                 cfg.rms_norm_eps, cfg.head_dim ** -0.5, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                                 (cfg.num_experts_per_tok, cfg.norm_topk_prob))


def test_prefill_is_declined_and_writes_nothing():
    llm = LLM("synth:tiny", backend="cpu", moe_backend="cpu")
    x = np.ones((1, llm.core.model_config.hidden_size), np.float32)
    before = llm.core.kv.k.copy()
    assert _stack_call(llm, x, _batch(1, True)) is None
    assert _stack_call(llm, x, _batch(1, False)) is not None            # the same step as decode: taken
    assert (x != 1).any() and not np.array_equal(llm.core.kv.k, before)


def test_one_array_qkv_is_split_where_other_layers_have_two_parts():
    """The q4_k_m fixture mixes the two forms (its first layer one q4_k array, its second a
    q|k + v pair); _qkv_as_parts splits the one array at the pairs' row and leaves other
    slots alone."""
    llm = LLM(CASES["q4_k and a q|k + v pair"][0], backend="cpu", moe_backend="cpu")
    assert [type(lw.qkv) for lw in llm.core.weights.layers] == [np.ndarray, tuple]
    one, pair = np.zeros((6, 2, 144), np.uint8), (np.zeros((4, 2, 144), np.uint8), np.zeros((2, 2, 210), np.uint8))
    rows = np.zeros((6, 8), np.uint32)
    layers = [("n", (one, 7, True, None, 0, False, None, None)), ("n", (pair[0], 7, True, pair[1], 9, True, None, None)),
              ("n", (None, 0, False, None, 0, False, rows, None))]
    split = decode_stack._qkv_as_parts(layers)
    q0, c0, i0, q1, c1, i1 = split[0][1][:6]
    assert q0.base is one and q1.base is one and q0.shape[0] == 4 and q1.shape[0] == 2 and (c0, i0, c1, i1) == (7, True, 7, True)
    assert split[1] == layers[1] and split[2] == layers[2]
    two_splits = [layers[0], layers[1], ("n", (pair[0][:3], 7, True, pair[1], 9, True, None, None))]
    assert decode_stack._qkv_as_parts(two_splits) == two_splits      # pairs split at two rows: as given
    grouped = [("n", (np.zeros((1, 2, 288), np.uint8), 12, True, None, 0, False, None, None)), layers[1]]
    assert decode_stack._qkv_as_parts(grouped) == grouped            # interleaved rows (16 an entry): as given


@pytest.mark.parametrize("slots, table, message", [
    (np.array([10**6], np.int32), None, "kv_write: slot 1000000 out of range"),
    (None, np.array([[-3]], np.int32), "attention: sequence 0 reads a slot outside"),
])
def test_bad_slots_raise_the_ops_errors_and_write_nothing(slots, table, message):
    llm = LLM("synth:tiny", backend="cpu", moe_backend="cpu")
    cfg, kv = llm.core.model_config, llm.core.kv
    x = np.ones((1, cfg.hidden_size), np.float32)
    before = kv.k.copy(), kv.v.copy()
    with pytest.raises(IndexError, match=message):
        _stack_call(llm, x, _batch(1, False, slots, table))
    assert (x == 1).all() and np.array_equal(kv.k, before[0]) and np.array_equal(kv.v, before[1])


def test_a_routing_trace_records_the_routes_run_in_the_call():
    """record_routing on a cpu engine: every one-token decode step's routes reach the trace (the
    experts ran inside the kernel call, reported through routed_inline)."""
    from freetoken import SamplingParams
    llm = LLM("synth:tiny", backend="cpu", moe_backend="cpu")
    llm.core.record_routing()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, ignore_eos=True))
    trace = llm.core.recorder.trace()
    L = len(llm.core.model_config.moe_layers)
    assert len(trace.ids) == 4 * L and sorted(set(trace.layer.tolist())) == list(range(L))
