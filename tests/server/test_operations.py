"""Operations: the access log, CORS for --allowed-origins, GET /v1/models/{id}, --chat-template,
and the /metrics histograms (valid Prometheus text)."""
import json
import logging
import math
import re
import time

import anthropic
import httpx
import openai
import pytest
from fake_core import FakeCore
from server_helpers import MODEL, ServerThread

from freetoken.models.demo import packaged_demo_dir
from freetoken.tokenizer import Tokenizer

ORIGIN = "https://app.example"


def chat(url: str, text: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}], **fields})


def access_lines(caplog, want: int = 0) -> list[str]:
    """The access-log lines so far; with `want`, waits up to 5 s for that many (a line is written
    after the response's last byte, so the client can hold its answer before the server logs it)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "freetoken.access"]
        if len(lines) >= want or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def test_access_log_has_one_line_per_request(fake_server, caplog):
    caplog.set_level(logging.INFO, logger="freetoken.access")
    usage = chat(fake_server.url, "SAY:one two three").json()["usage"]
    assert chat(fake_server.url, "SAY:x", model="nope").status_code == 404
    assert httpx.get(fake_server.url + "/health").status_code == 200
    lines = access_lines(caplog, want=3)
    assert len(lines) == 3, lines
    m = re.fullmatch(r'127\.0\.0\.1:\d+ "POST /v1/chat/completions" 200 \| prompt (\d+) \(cached (\d+)\) \| '
                     r'output (\d+) \| ttft (\d+\.\d{3})s \| (\d+\.\d{3})s', lines[0])
    assert m, lines[0]
    prompt, cached, output, ttft, total = int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])
    assert (prompt, cached, output) == (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                        usage["completion_tokens"])
    assert 0 <= ttft <= total
    # a 4xx line ends with the error's message: what the client was told
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "POST /v1/chat/completions" 404 \| \d+\.\d{3}s \| .*\bnope\b.*', lines[1]), lines[1]
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "GET /health" 200 \| \d+\.\d{3}s', lines[2]), lines[2]


def test_no_access_log(demo_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="freetoken.access")
    server = ServerThread(lambda: FakeCore(demo_tokenizer), access_log=False).start()
    try:
        assert chat(server.url, "SAY:x").status_code == 200
    finally:
        server.stop()
    assert access_lines(caplog) == []


@pytest.fixture(scope="module")
def cors_server(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), api_key="k", allowed_origins=ORIGIN).start()
    yield server
    server.stop()


def test_preflight_for_an_allowed_origin(cors_server):
    r = httpx.options(cors_server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})     # no key: preflights carry none
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"


def test_allowed_origin_gets_cors_headers_on_every_answer(cors_server):
    key = {"Authorization": "Bearer k", "Origin": ORIGIN}
    r = httpx.post(cors_server.url + "/v1/chat/completions", headers=key, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "SAY:hi"}], "stream": True})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "Origin" in r.headers["vary"]
    r = httpx.get(cors_server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_for_other_origins(cors_server, fake_server):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(cors_server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    local = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    r = httpx.options(fake_server.url + "/v1/chat/completions", headers=local)    # nothing by default
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(fake_server.url + "/health", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_models_retrieve_through_the_sdk(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), served_model_name=f"{MODEL},org/alias").start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for name in (MODEL, "org/alias"):
            card = client.models.retrieve(name)
            assert card.id == name and card.owned_by == "freetoken" and card.context_length == 2048
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("gpt-9")
        assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "not_found_error"
    finally:
        server.stop()


def test_chat_template_file_replaces_the_models(demo_tokenizer, tmp_path):
    path = tmp_path / "custom.jinja"
    path.write_text("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    own = Tokenizer.from_dir(packaged_demo_dir())     # the server installs the template in its tokenizer
    server = ServerThread(lambda: FakeCore(own), chat_template=str(path)).start()
    try:
        r = chat(server.url, "ECHO")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "[USER] ECHO\n[ASSISTANT]"
        r = httpx.post(server.url + "/v1/messages/count_tokens", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "ECHO"}]})
        assert r.json()["input_tokens"] == len(demo_tokenizer.encode("[USER] ECHO\n[ASSISTANT]"))
    finally:
        server.stop()


def parse_prometheus(text: str) -> dict:
    """{family: (type, [(name, labels, value)])}, checking the text format line by line."""
    families, current = {}, None
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# HELP "):
            current = line.split(" ")[2]
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == current and kind in {"counter", "gauge", "histogram", "summary"}, line
            families[name] = (kind, [])
        else:
            # Prometheus' metric-name grammar (colons included: the gateway gauges are vllm:...)
            m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-z_]+="[^"]*",?)*)\})? (\S+)', line)
            assert m, line
            suffix = m[1][len(current):]
            assert m[1].startswith(current) and suffix in ("", "_bucket", "_sum", "_count"), line
            labels = dict(re.findall(r'([a-z_]+)="([^"]*)"', m[2] or ""))
            families[current][1].append((m[1], labels, float(m[3])))
    return families


def check_histogram(samples: list) -> tuple[float, float]:
    buckets = [(float(labels["le"]), v) for name, labels, v in samples if name.endswith("_bucket")]
    total = {name.rsplit("_", 1)[1]: v for name, _, v in samples if name.endswith(("_sum", "_count"))}
    assert buckets[-1][0] == math.inf and buckets[-1][1] == total["count"], samples
    assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets
    return total["sum"], total["count"]


def test_metrics_histograms(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer)).start()
    try:
        for text in ("SAY:a b c d", "SAY:x"):
            assert chat(server.url, text).status_code == 200
        families = parse_prometheus(httpx.get(server.url + "/metrics").text)
    finally:
        server.stop()
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds"):
        assert families["freetoken_" + name][0] == "histogram"
    assert check_histogram(families["freetoken_time_to_first_token_seconds"][1])[1] == 2
    assert check_histogram(families["freetoken_request_duration_seconds"][1])[1] == 2
    outputs = families["freetoken_generation_tokens_total"][1][0][2]          # 5 + 2 tokens (with eos)
    assert check_histogram(families["freetoken_inter_token_latency_seconds"][1])[1] == outputs - 2


def test_anthropic_stream_usage_agrees_from_message_start_on():
    """message_start reports the prefix-cache reads that message_delta reports (demo model)."""
    from freetoken.config import EngineConfig
    from freetoken.engine.core import EngineCore
    server = ServerThread(lambda: EngineCore(EngineConfig(model=str(packaged_demo_dir())))).start(wait_ready=False)
    assert server.engine.wait_ready(300), server.engine.error
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
        ask = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Write a queue."}]}
        client.messages.create(**ask)                        # puts the prompt in the prefix cache
        with client.messages.stream(**ask) as stream:
            events = list(stream)
    finally:
        server.stop()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens) == (delta.input_tokens, delta.cache_read_input_tokens)


def test_an_error_line_carries_the_message_shortened_to_one_line():
    from freetoken.server.access import MAX_REASON, _error_message
    anthropic_shape = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad\n  field"}}
    assert _error_message(json.dumps(anthropic_shape).encode()) == "bad field"
    long = _error_message(json.dumps({"error": {"message": "word " * 200}}).encode())
    assert len(long) == MAX_REASON and long.endswith("...")
    assert _error_message(b"<html>not json</html>") == "" and _error_message(b"[1, 2]") == ""
