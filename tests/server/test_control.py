"""Health while loading, API keys, browser origins, metrics, cache status and rebuild, ctl."""
import argparse
import json
import threading

import httpx
import pytest
from fake_core import FakeCore
from server_helpers import MODEL, ServerThread, cache_status, wait_idle

from freetoken.server.run import EXIT_FAILED


def chat_body(text, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def test_health_is_503_while_loading(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer, load_seconds=1.0)).start(wait_ready=False)
    try:
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(server.url + "/v1/chat/completions", json=chat_body("SAY:x"))
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        r = httpx.post(server.url + "/v1/messages", json={**chat_body("SAY:x"), "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL
        assert server.engine.wait_ready(30)
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        server.stop()


def test_failed_load_is_reported():
    def broken():
        raise OSError("weights are missing")
    server = ServerThread(broken).start(wait_ready=False)
    try:
        assert not server.engine.wait_ready(30)
        assert server.engine.state == "failed" and "weights are missing" in server.engine.error
        server._thread.join(30)             # a failed load shuts the server down by itself
        assert not server._thread.is_alive() and server.exit_code == EXIT_FAILED
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyed(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), api_key="k1, k2",
                          allowed_origins="https://app.example").start()
    yield server
    server.stop()


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/v1/cache/status"])
def test_api_key_protects_every_route_but_health(keyed, path):
    assert httpx.get(keyed.url + "/health").status_code == 200
    r = httpx.get(keyed.url + path)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(keyed.url + path, headers={"Authorization": "Bearer k2"}).status_code == 200
    assert httpx.get(keyed.url + path, headers={"x-api-key": "k1"}).status_code == 200


def test_api_key_with_sdks(keyed):
    import anthropic
    import openai
    bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=keyed.url, api_key="k1", max_retries=0)
    assert good.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "SAY:y"}]
                                ).content[0].text == "y"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=keyed.url + "/v1", api_key="k2", max_retries=0).models.list().data


@pytest.mark.parametrize("origin,status", [("http://evil.example", 403), ("http://localhost:3000", 200),
                                           ("http://127.0.0.1:8080", 200), ("https://app.example", 200),
                                           ("null", 403)])
def test_browser_origins(keyed, origin, status):
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": origin, "x-api-key": "k1"})
    assert r.status_code == status


def test_metrics(fake_server):
    httpx.post(fake_server.url + "/v1/chat/completions", json=chat_body("SAY:metric me"))
    text = httpx.get(fake_server.url + "/metrics").text
    for name in ["freetoken_requests_total", "freetoken_prompt_tokens_total", "freetoken_generation_tokens_total",
                 "freetoken_queue_waiting", "freetoken_requests_running", "freetoken_kv_slots",
                 "freetoken_kv_occupancy_ratio", "freetoken_prefix_cache_hit_tokens_total",
                 "freetoken_moe_hits_total", "freetoken_moe_misses_total", "freetoken_moe_fills_total",
                 "freetoken_moe_cpu_execs_total", "freetoken_decode_tokens_per_second",
                 "freetoken_time_to_first_token_seconds_count", "freetoken_http_requests_total"]:
        assert f"\n{name}" in text, name
    assert 'freetoken_requests_total{route="/v1/chat/completions",finish_reason="stop"}' in text
    # the names gateway schedulers (llm-d) read, with vLLM's model_name label and a [0, 1] fraction
    gauges = {line.split("{")[0]: line for line in text.splitlines() if line.startswith("vllm:")}
    assert set(gauges) == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
    assert all(f'{{model_name="{MODEL}"}}' in line for line in gauges.values()), gauges
    assert 0 <= float(gauges["vllm:kv_cache_usage_perc"].rsplit(" ", 1)[1]) <= 1
    assert "# TYPE vllm:num_requests_waiting gauge" in text
    for line in text.splitlines():       # every sample line is "name{labels} number"
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_keepalive_pings_while_waiting(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), sse_ping_interval=0.05).start()
    try:
        body = chat_body("SLEEP:150 SAY:x", stream=True)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert ": ping" in lines and lines[-1] == "data: [DONE]"
        with httpx.stream("POST", server.url + "/v1/messages", json={**body, "max_tokens": 20}, timeout=30) as r:
            text = r.read().decode()
        assert "event: ping" in text and text.index("event: message_start") < text.index("event: ping")
    finally:
        server.stop()


def test_cache_status(fake_server):
    s = wait_idle(fake_server.url)
    assert s["state"] == "ready" and s["idle"] and s["kv"]["slots"] == fake_server.core.kv.num_slots
    assert s["kv"]["leaked"] == 0 and s["requests"] == {"running": 0, "waiting": 0, "in_flight": 0}
    assert "layers" not in s["moe"] and "hits" in s["moe"]["total"]


def test_rebuild_idle_invalid_and_busy(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer)).start()
    url = server.url
    try:
        r = httpx.post(url + "/v1/cache/rebuild", json={"num_kv_tokens": 4096, "moe_cache_size": 10})
        assert r.status_code == 200 and r.json()["kv"]["slots"] == 4096
        assert r.json()["last_rebuild"]["requested"] == {"num_kv_tokens": 4096, "moe_cache_size": 10}
        r = httpx.post(url + "/v1/cache/rebuild", json={"num_kv_tokens": 4})
        assert r.status_code == 400 and "geometry" in r.json()["error"]["message"]
        assert cache_status(url)["kv"]["slots"] == 4096
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                          json=chat_body("REPEAT:100 SLEEP:20", stream=True)) as stream:
            lines = stream.iter_lines()
            while '"k"' not in next(lines):      # the request is in the engine once tokens flow
                pass
            r = httpx.post(url + "/v1/cache/rebuild", json={"num_kv_tokens": 8192})
            assert r.status_code == 409 and r.json()["error"]["code"] == "engine_busy"
        wait_idle(url)
        assert httpx.post(url + "/v1/cache/rebuild", json={"num_kv_tokens": 8192}).status_code == 200
        assert cache_status(url)["kv"]["slots"] == 8192
    finally:
        server.stop()


def test_rebuild_while_requests_arrive(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer)).start()
    url = server.url
    results, codes = [], []

    def client(i):
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(f"SLEEP:2 SAY:answer {i}"), timeout=60)
        results.append((i, r.status_code, r.json()["choices"][0]["message"]["content"]))
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for i, t in enumerate(threads):
            t.start()
            if i % 3 == 0:
                size = 4096 + 1024 * (i % 2)
                codes.append(httpx.post(url + "/v1/cache/rebuild", json={"num_kv_tokens": size}).status_code)
        for t in threads:
            t.join(60)
        assert sorted(results) == [(i, 200, f"answer {i}") for i in range(12)]
        assert set(codes) <= {200, 409}
        while httpx.post(url + "/v1/cache/rebuild", json={"num_kv_tokens": 2048}).status_code == 409:
            pass
        s = wait_idle(url)
        assert s["kv"]["slots"] == 2048 and s["kv"]["leaked"] == 0
    finally:
        server.stop()


def run_ctl(url: str, *argv: str) -> int:
    from freetoken.commands import ctl
    parser = argparse.ArgumentParser()
    ctl.register(parser.add_subparsers())
    args = parser.parse_args(["ctl", "--url", url, *argv])
    return args.run(args)


def test_ctl(fake_server, capsys):
    assert run_ctl(fake_server.url, "health") == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    assert run_ctl(fake_server.url, "cache", "status") == 0
    assert json.loads(capsys.readouterr().out)["kv"]["leaked"] == 0
    slots = fake_server.core.kv.num_slots
    assert run_ctl(fake_server.url, "cache", "rebuild", "--num-kv-tokens", str(slots)) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    assert run_ctl(fake_server.url, "cache", "rebuild", "--num-kv-tokens", "3") == 1
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "invalid_request_error"
