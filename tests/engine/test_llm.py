"""End-to-end generation on the packaged demo model through the public LLM API."""
import pytest

from freetoken import LLM, SamplingParams
from freetoken.engine.request import InvalidRequest

PROMPT = "import os\nimport sys\n\n\ndef "


@pytest.fixture(scope="module")
def llm():
    return LLM(backend="cpu", moe_backend="fused")


def test_greedy_is_deterministic_and_readable(llm):
    a = llm.generate(PROMPT, SamplingParams(max_tokens=24))[0]
    b = llm.generate(PROMPT, SamplingParams(max_tokens=24))[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert "(" in a.text                     # the demo model writes a function signature


def test_batch_equals_single(llm):
    prompts = [PROMPT, "class Foo:\n    def ", "x = [i for i in "]
    params = SamplingParams(max_tokens=12)
    batched = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert llm.core.kv.num_free == llm.core.kv.num_slots      # no KV slot leaked


def test_chunked_prefill_matches_one_shot(llm):
    long_prompt = PROMPT * 6
    one = llm.generate(long_prompt, SamplingParams(max_tokens=8))[0]
    chunked = LLM(backend="cpu", moe_backend="fused", chunked_prefill_size=7)
    assert chunked.generate(long_prompt, SamplingParams(max_tokens=8))[0].token_ids == one.token_ids


def test_ref_and_cpu_agree(llm):
    ref = LLM(backend="ref", moe_backend="fused")
    params = SamplingParams(max_tokens=10)
    assert ref.generate(PROMPT, params)[0].token_ids == llm.generate(PROMPT, params)[0].token_ids


def test_max_tokens_and_stop_string(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    full = llm.generate(PROMPT, SamplingParams(max_tokens=24))[0].text
    stop = full[3:6]
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=24, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_seeded_sampling_reproducible(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    assert llm.generate(PROMPT, params)[0].token_ids == llm.generate(PROMPT, params)[0].token_ids


def test_bad_requests_are_clear_errors(llm):
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequest, match="2048"):
        llm.generate([[5] * 3000], SamplingParams())
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(TypeError):
        LLM(backend="cpu", not_a_field=1)
