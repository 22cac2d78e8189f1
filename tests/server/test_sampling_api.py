"""Item 4 of the harness issue through the official openai SDK against `serve` on the demo model:
logprobs/top_logprobs (chat, completions, Responses), completions echo with prompt logprobs (the
lm-evaluation-harness loglikelihood request), n > 1 sharing the prompt, penalties, logit_bias."""
import openai
import pytest
from server_helpers import MODEL

ASK = [{"role": "user", "content": "Write a function."}]
PROMPT = "import os\nimport sys\n\n\ndef "


def test_chat_logprobs_and_top_logprobs(oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                   logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token            # greedy: the most probable
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    shown = bytes(b for e in content for b in e.bytes).decode("utf-8", "replace")
    assert r.choices[0].message.content in shown       # the tokens spell the reply (plus any end token)
    plain = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_stream_carries_the_logprobs(oa):
    chunks = list(oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=2, stream=True,
                                             stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    whole = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True)
    assert [e.logprob for e in entries] == [e.logprob for e in whole.choices[0].logprobs.content]


def test_completions_echo_scores_the_prompt_like_lm_eval(oa):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1, temperature 0;
    it sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each equals the top."""
    tok = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).usage.prompt_tokens
    ids = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    lp = ids.choices[0].logprobs
    assert ids.choices[0].text == PROMPT and len(lp.tokens) == tok and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and ids.usage.completion_tokens == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    r = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    full = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT) and len(full.tokens) == tok + 1
    assert full.token_logprobs[:tok] == lp.token_logprobs                 # the same scores either way
    assert full.token_logprobs[-1] == max(full.top_logprobs[-1].values())  # greedy: the top one


def test_completions_logprobs_without_echo_and_streamed(oa):
    r = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens).startswith(r.choices[0].text)
    chunks = list(oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0,
                                        echo=True, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == PROMPT + r.choices[0].text and streamed[0] is None
    assert streamed[-5:] == pytest.approx(lp.token_logprobs, abs=1e-4)   # lm_head over more rows: other rounding


def test_n_choices_share_the_prompt_and_differ(oa, demo_server):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1                     # seed, seed+1, seed+2
    again = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    single = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=7)
    assert single.choices[0].message.content == r.choices[0].message.content
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    # the later choices reused the first one's prompt: the server log says how much each had cached
    lines = [l for l in demo_server.stderr_lines if f"{r.id}-" in l and "/v1/chat/completions" in l]
    assert len(lines) == 2 and all(f"(cached {r.usage.prompt_tokens - 1})" in l for l in lines), lines


def test_n_choices_stream_with_indices(oa):
    chunks = list(oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0.8,
                                             n=2, stream=True, stream_options={"include_usage": True}))
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1] and chunks[-1].usage.completion_tokens >= 2
    r = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text


def test_logit_bias_and_penalties(oa, demo_tokenizer):
    x = demo_tokenizer.encode("x")[0]
    forced = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(x): 100})
    assert forced.choices[0].text == "xxxx"
    plain = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = demo_tokenizer.encode(first)[0]
    assert demo_tokenizer.decode([first_id]) == first
    banned = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                   logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    pen = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, frequency_penalty=2.0,
                                presence_penalty=2.0, extra_body={"repetition_penalty": 1.5})
    again = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert pen.choices[0].text != again.choices[0].text


def test_responses_logprobs_stream_and_not(oa):
    # reasoning off: the demo model opens its replies with a (empty) think block otherwise, whose
    # tokens the output_text logprobs would then start with (docs/api.md: a known gap)
    r = oa.responses.create(model=MODEL, input="Write a function.", max_output_tokens=8, temperature=0,
                            top_logprobs=2, include=["message.output_text.logprobs"], reasoning={"effort": "none"})
    part = next(i for i in r.output if i.type == "message").content[0]
    assert part.logprobs and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)
    assert "".join(e.token for e in part.logprobs).startswith(part.text)
    events = list(oa.responses.create(model=MODEL, input="Write a function.", max_output_tokens=8, temperature=0,
                                      top_logprobs=2, include=["message.output_text.logprobs"], stream=True,
                                      reasoning={"effort": "none"}))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    same = lambda a, b: len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b))   # prefix-cache hit
    assert same([e.logprob for e in deltas], [e.logprob for e in part.logprobs][:len(deltas)])
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    assert same([e.logprob for e in done.logprobs], [e.logprob for e in part.logprobs])
    plain = oa.responses.create(model=MODEL, input="Write a function.", max_output_tokens=4, reasoning={"effort": "none"})
    assert next(i for i in plain.output if i.type == "message").content[0].logprobs == []


def test_completions_batch_of_token_prompts_as_lm_eval_sends(oa, demo_tokenizer):
    """lm-eval's loglikelihood payload with batch_size 2: two token-id prompts in one request;
    choices come back per prompt (index = prompt * n + j) and score like single requests."""
    a, b = demo_tokenizer.encode(PROMPT), demo_tokenizer.encode("class Foo:\n    def ")
    payload = dict(model=MODEL, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    r = oa.completions.create(prompt=[a, b], **payload)
    assert [c.index for c in r.choices] == [0, 1]
    for ids, choice in zip((a, b), r.choices):
        alone = oa.completions.create(prompt=[ids], **payload).choices[0].logprobs
        # not bit for bit: a batch of two prompts is one prefill of more rows (BLAS tiles them
        # otherwise), and the default --cpu-dots rounds the experts' activations to bf16, which
        # turns an fp32 summation-order difference into a bf16 step (2^-8 of a value) now and
        # then: 1.4e-4 seen on the Xeon EMR VM (under --cpu-dots f32 it agreed within 1e-5)
        assert choice.logprobs.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-3)
        assert len(choice.logprobs.tokens) == len(ids) + 1
    assert r.usage.prompt_tokens == len(a) + len(b) and r.usage.completion_tokens == 2
    texts = oa.completions.create(model=MODEL, prompt=["x = ", "y = "], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    assert texts.choices[0].text == texts.choices[1].text
    ended = sum(c.finish_reason == "stop" for c in texts.choices)     # a choice may end on its own
    assert texts.usage.completion_tokens == 12 if not ended else 4 <= texts.usage.completion_tokens < 12
    stream = list(oa.completions.create(model=MODEL, prompt=["x = ", "y = "], max_tokens=3, temperature=0,
                                        echo=True, stream=True))
    by_index = {}
    for c in stream:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
    assert by_index == {0: "x = " + texts.choices[0].text, 1: "y = " + texts.choices[2].text}
