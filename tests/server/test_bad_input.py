"""The bad-input battery against the scripted core: every malformed request gets its 4xx in the
API's own error shape, the server stays up, and no KV slot is leaked."""
import httpx
import pytest
from bad_requests import CASES, check_error_shape, send
from fake_core import FakeCore
from server_helpers import MODEL, ServerThread, wait_idle


@pytest.fixture(scope="module")
def server(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), max_body_bytes=1 << 20).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def test_battery_is_big_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request(http, name):
    request, status = CASES[name]
    r = send(http, request)
    assert r.status_code == status, (name, r.text[:300])
    check_error_shape(r, request[1])


def test_context_error_carries_token_counts(http):
    request, _ = CASES["prompt beyond the context"]
    error = send(http, request).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["prompt_tokens"] > 2048
    assert "2048" in error["message"] and str(error["prompt_tokens"]) in error["message"]


def test_server_alive_and_nothing_leaked(http, server):
    for name in CASES:               # once more, in one burst
        send(http, CASES[name][0])
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "SAY:ok"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    status = wait_idle(server.url)
    assert status["idle"] and status["kv"]["leaked"] == 0 and status["kv"]["free"] + status["kv"]["prefix_cached"] == status["kv"]["slots"]


def test_a_tool_schema_that_is_not_one_is_named_through_the_sdks(server):
    """The 400 says which field and where in the schema, as the official SDKs surface it."""
    import anthropic
    import openai
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    bad = {"type": "object", "properties": {"path": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   tools=[{"type": "function", "function": {"name": "read", "parameters": bad}}])
    error = e.value.body
    assert error["param"] == "tools[0].function.parameters", error
    assert "not a valid JSON Schema" in error["message"] and "properties.path.type" in error["message"], error
    an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\]\.input_schema is not a valid JSON Schema"):
        an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                           tools=[{"name": "read", "input_schema": bad}])
