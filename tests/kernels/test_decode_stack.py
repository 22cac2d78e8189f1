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
    core, cfg = stacked.core, stacked.core.model_config
    banks = [core.model.moe.inline_bank(j, False) for j in range(len(core.weights.layers))]
    x = np.zeros((2, cfg.hidden_size), np.float32)
    assert core.ops.decode_stack(x, core.weights.layers, core.kv, banks, _batch(2, False), core.model.inv_freq,
                                 1e-6, 0.25, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (2, True)) is None


def test_prefill_is_declined():
    llm = LLM("synth:tiny", backend="cpu", moe_backend="cpu")
    model, cfg = llm.core.model, llm.core.model_config
    x = np.zeros((4, cfg.hidden_size), np.float32)
    assert not model._decode_stack(x, _batch(4, True))


@pytest.mark.parametrize("slots, table, message", [
    (np.array([10**6], np.int32), None, "kv_write: slot 1000000 out of range"),
    (None, np.array([[-3]], np.int32), "attention: sequence 0 reads a slot outside"),
])
def test_bad_slots_raise_the_ops_errors_and_write_nothing(slots, table, message):
    llm = LLM("synth:tiny", backend="cpu", moe_backend="cpu")
    model, cfg, kv = llm.core.model, llm.core.model_config, llm.core.kv
    x = np.ones((1, cfg.hidden_size), np.float32)
    before = kv.k.copy(), kv.v.copy()
    with pytest.raises(IndexError, match=message):
        model._decode_stack(x, _batch(1, False, slots, table))
    assert (x == 1).all() and np.array_equal(kv.k, before[0]) and np.array_equal(kv.v, before[1])
