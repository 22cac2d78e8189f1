"""Context and length honesty (issue 11 item 5), through the official SDKs: a prompt that does not
fit is a 400 with the counts in each API's own wording; a max_tokens beyond what the prompt leaves
is shortened to it by default (the answer then ends with length / max_tokens, and an INFO line
says so) or, with --max-tokens-beyond-room refuse, a 400 with the counts; a budget the server chose
is shortened to fit, --default-max-tokens caps requests that give none, and ``serve`` takes synth:
models and a --max-model-len beyond the trained length (with a warning)."""
import logging
import re

import anthropic
import httpx
import openai
import pytest
from bad_requests import LONG_PROMPT
from fake_core import FakeCore
from server_helpers import MODEL, ServerProcess, ServerThread

CONTEXT = 2048           # the scripted core's context (conftest's fake_server)
USER = [{"role": "user", "content": "SAY:ok"}]


@pytest.fixture(scope="module")
def oa(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def an(fake_server):
    return anthropic.Anthropic(base_url=fake_server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def refusing(demo_tokenizer):
    """The scripted core served with --max-tokens-beyond-room refuse: (OpenAI, Anthropic) clients."""
    server = ServerThread(lambda: FakeCore(demo_tokenizer), max_tokens_beyond_room="refuse").start()
    yield (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
           anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60))
    server.stop()


def prompt_tokens(tokenizer, messages) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages)))


def openai_error(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.response.json()["error"]


def anthropic_error(call) -> dict:
    with pytest.raises(anthropic.BadRequestError) as e:
        call()
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_openai_max_tokens_that_does_not_fit_is_400_when_refused(refusing, demo_tokenizer, key):
    oa = refusing[0]
    p = prompt_tokens(demo_tokenizer, USER)
    err = openai_error(lambda: oa.chat.completions.create(model=MODEL, messages=USER, **{key: CONTEXT - p + 1}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    n = CONTEXT - p + 1
    assert f"too large: {n}" in err["message"] and f"({n} > {CONTEXT} - {p})" in err["message"]
    assert (err["prompt_tokens"], err["max_tokens"], err["context_length"]) == (p, CONTEXT - p + 1, CONTEXT)
    r = oa.chat.completions.create(model=MODEL, messages=USER, **{key: CONTEXT - p})     # exactly what is left
    assert r.choices[0].message.content == "ok"


def test_openai_without_max_tokens_gets_what_is_left(oa, demo_tokenizer):
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "REPEAT:3"}])
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(demo_tokenizer.encode("tok " * 3)) + 1      # + end of sequence


def test_completions_max_tokens_that_does_not_fit_is_400_when_refused(refusing, demo_tokenizer):
    oa = refusing[0]
    p = len(demo_tokenizer.encode("SAY:ok"))
    err = openai_error(lambda: oa.completions.create(model=MODEL, prompt="SAY:ok", max_tokens=CONTEXT))
    assert err["code"] == "context_length_exceeded" and f"({CONTEXT} > {CONTEXT} - {p})" in err["message"]
    assert oa.completions.create(model=MODEL, prompt="SAY:ok").usage.completion_tokens <= 16


def test_openai_prompt_beyond_the_context(oa, demo_tokenizer):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    p = prompt_tokens(demo_tokenizer, messages)
    err = openai_error(lambda: oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
    assert err["code"] == "context_length_exceeded" and err["prompt_tokens"] == p > CONTEXT
    assert f"maximum context length is {CONTEXT} tokens" in err["message"] and f"has {p} input tokens" in err["message"]


def test_anthropic_max_tokens_that_does_not_fit_in_anthropic_words_when_refused(refusing, demo_tokenizer):
    an = refusing[1]
    p = prompt_tokens(demo_tokenizer, USER)
    expected = (f"input length and `max_tokens` exceed context limit: {p} + 32000 > {CONTEXT}, "
                f"decrease input length or `max_tokens` and try again")
    for stream in (False, True):       # the stream is refused before it starts, as a JSON 400
        err = anthropic_error(lambda: an.messages.create(model=MODEL, max_tokens=32000, messages=USER, stream=stream))
        assert err["message"] == expected
    m = an.messages.create(model=MODEL, max_tokens=CONTEXT - p, messages=USER)
    assert m.content[0].text == "ok"


def test_max_tokens_beyond_the_room_is_shortened_by_default(oa, an, demo_tokenizer, caplog):
    """Claude Code asks max_tokens 32000 and, on the 400, retries only when the context leaves 4000
    tokens past its prompt, which the demo model's 2048 never do ("Prompt is too long", exit 1):
    by default the server serves what is left, says so in an INFO line, and an answer that
    reaches it ends with length / max_tokens."""
    caplog.set_level(logging.INFO, logger="freetoken")
    messages = [{"role": "user", "content": f"REPEAT:{CONTEXT}"}]
    room = CONTEXT - prompt_tokens(demo_tokenizer, messages)
    m = an.messages.create(model=MODEL, max_tokens=32000, messages=messages)
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", room)
    with an.messages.stream(model=MODEL, max_tokens=32000, messages=messages) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", room)
    r = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=CONTEXT)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", room)
    said = [rec.getMessage() for rec in caplog.records if "shortened" in rec.getMessage()]
    assert f"max_tokens 32000 shortened to {room}" in said[0] and f"max_tokens {CONTEXT} shortened" in said[-1]
    m = an.messages.create(model=MODEL, max_tokens=32000, messages=USER)     # room left over
    assert (m.stop_reason, m.content[0].text) == ("end_turn", "ok")


def test_anthropic_prompt_too_long_and_count_tokens_still_counts(an):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    n = an.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert n > CONTEXT
    err = anthropic_error(lambda: an.messages.create(model=MODEL, max_tokens=10, messages=messages))
    assert err["message"] == f"prompt is too long: {n} tokens > {CONTEXT - 1} maximum"
    assert re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", err["message"])


def test_models_report_what_a_small_kv_pool_leaves():
    """`serve --num-kv-tokens 1000` on the demo model (context 2048): the model card's length is
    what one request can hold, 1000, the number the 400 for a longer prompt names."""
    proc = ServerProcess("--num-kv-tokens", "1000")
    try:
        oa = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        (card,) = oa.models.list().data
        assert card.model_extra["max_model_len"] == card.model_extra["context_length"] == 1000
        assert oa.models.retrieve(MODEL).model_extra["context_length"] == 1000
        messages = [{"role": "user", "content": "def f(x):\n    return x\n" * 200}]      # 1000..2048 tokens
        err = openai_error(lambda: oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
        assert err["context_length"] == 1000 and 1000 <= err["prompt_tokens"] < 2048, err
        an = anthropic.Anthropic(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
        err = anthropic_error(lambda: an.messages.create(model=MODEL, max_tokens=5, messages=messages))
        assert err["message"].endswith("tokens > 999 maximum"), err
    finally:
        assert proc.stop() == 0, "".join(proc.stderr_lines)[-2000:]


def test_kv_pool_smaller_than_the_context_is_the_limit(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer, max_model_len=CONTEXT, kv_tokens=1024)).start()
    try:
        messages = [{"role": "user", "content": "def f(x):\n    return x\n" * 200}]      # 1024..2048 tokens
        p = prompt_tokens(demo_tokenizer, messages)
        assert 1024 <= p < CONTEXT
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        err = openai_error(lambda: oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
        assert "KV pool holds 1024 tokens (--num-kv-tokens)" in err["message"] and err["context_length"] == 1024
        an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        err = anthropic_error(lambda: an.messages.create(model=MODEL, max_tokens=5, messages=messages))
        assert err["message"] == f"prompt is too long: {p} tokens > 1023 maximum"
        assert oa.models.retrieve(MODEL).model_extra["context_length"] == 1024
        r = httpx.post(server.url + "/v1/cache/rebuild", json={"num_kv_tokens": 512}, timeout=30)
        assert r.status_code == 200, r.text
        (card,) = oa.models.list().data                                     # the pool's new size
        assert card.model_extra["max_model_len"] == card.model_extra["context_length"] == 512
    finally:
        server.stop()


@pytest.mark.parametrize("default, asked, got", [(5, None, 5), (5, 8, 8), (100_000, None, None)])
def test_default_max_tokens_caps_requests_that_give_none(demo_tokenizer, default, asked, got):
    whole = len(demo_tokenizer.encode("tok " * 40)) + 1
    got = got or whole
    server = ServerThread(lambda: FakeCore(demo_tokenizer), default_max_tokens=default).start()
    try:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kw = {} if asked is None else {"max_tokens": asked}
        r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "REPEAT:40"}], **kw)
        assert r.usage.completion_tokens == got      # 100000 > what is left: shortened, not refused
        assert r.choices[0].finish_reason == ("length" if got < whole else "stop")
    finally:
        server.stop()


def test_default_max_tokens_flag_comes_from_the_config_field():
    from freetoken.cli import build_parser
    from freetoken.flags import config_from_args
    from freetoken.server.config import ServerConfig
    args = build_parser().parse_args(["serve", "--default-max-tokens", "7"])
    assert config_from_args(args, ServerConfig).default_max_tokens == 7


def test_serve_synth_model_beyond_its_trained_length():
    """synth:tiny is trained (max_position_embeddings) for 1024 positions; ask for 2048."""
    proc = ServerProcess("--model", "synth:tiny", "--max-model-len", "2048")
    try:
        (card,) = httpx.get(proc.url + "/v1/models").json()["data"]
        assert card["id"] == "synth:tiny" and card["max_model_len"] == 2048
        r = httpx.post(proc.url + "/v1/completions", timeout=120,
                       json={"model": "synth:tiny", "prompt": [7] * 1500, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text                     # past 1024: not capped
        assert r.json()["usage"] == {"prompt_tokens": 1500, "completion_tokens": 3, "total_tokens": 1503,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
    finally:
        code = proc.stop()
    log = "".join(proc.stderr_lines)
    assert code == 0, log[-2000:]
    assert "WARNING --max-model-len 2048 is beyond the 1024 positions the model was trained on" in log, log
    assert "output quality past 1024 tokens is not guaranteed" in log


def test_responses_max_output_tokens_that_does_not_fit(oa, refusing, demo_tokenizer):
    """The Responses route follows chat: a given max_output_tokens past the context is shortened
    (the response is incomplete when it runs out), or refused when the server refuses."""
    r = oa.responses.create(model=MODEL, input=f"REPEAT:{CONTEXT}", max_output_tokens=CONTEXT)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens < CONTEXT
    oa = refusing[0]
    err = openai_error(lambda: oa.responses.create(model=MODEL, input="SAY:ok", max_output_tokens=CONTEXT))
    assert err["code"] == "context_length_exceeded" and "too large" in err["message"]
    assert oa.responses.create(model=MODEL, input="SAY:ok", max_output_tokens=16).output_text == "ok"
