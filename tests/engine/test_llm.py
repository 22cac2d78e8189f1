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
    assert_no_leak(llm)


def assert_no_leak(llm):
    """Every KV slot is either free or held by the prefix cache, exactly once."""
    core = llm.core
    cache = core.prefix_cache
    cache.check()
    assert core.kv.num_free + cache.size == core.kv.num_slots
    assert cache.protected_size == 0


def test_prefix_reuse_across_turns():
    llm = LLM(backend="cpu", moe_backend="fused")       # a fresh, empty prefix cache
    first = llm.generate(PROMPT, SamplingParams(max_tokens=8))[0]
    follow = first.prompt_token_ids + first.token_ids + llm.tokenizer.encode("\n\nclass ")
    req = llm.core.add_request(follow, SamplingParams(max_tokens=4))
    while req.finish_reason is None:
        llm.core.step()
    # Everything the first request computed is reused: its prompt and all but its last token.
    assert req.num_cached == len(first.prompt_token_ids) + len(first.token_ids) - 1
    no_cache = LLM(backend="cpu", moe_backend="fused", enable_prefix_cache=False)
    assert no_cache.generate([follow], SamplingParams(max_tokens=4))[0].token_ids == req.output_ids
    assert_no_leak(llm)


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
