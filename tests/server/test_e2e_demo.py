"""End to end: ``python -m freetoken serve`` on the demo model, driven by the openai and anthropic
SDKs. One server process for the module (it starts in seconds)."""
import json
import threading

import anthropic
import httpx
import openai
import pytest
from bad_requests import CASES, check_error_shape, send
from server_helpers import MODEL, cache_status, check_concurrent_streams, wait_idle

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a text file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
ASK = [{"role": "user", "content": "Write Python code."}]


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_health_models_and_ready_line(server, oa):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    (card,) = oa.models.list().data
    assert card.id == MODEL and card.model_extra["context_length"] == 2048


def test_chat_and_stream_agree(oa):
    whole = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content and whole.choices[0].finish_reason in ("stop", "length")
    assert 0 < whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 5
    chunks = list(oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_sequence(oa):
    text = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0).choices[0].message.content
    cut = text.strip()[len(text.strip()) // 2:][:3]
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0, stop=[cut])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[:text.index(cut)]


def test_completions(oa):
    r = oa.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8


def test_tool_round_trip(oa, an):
    """A client-made call and the tool's result go back in; both APIs count the same prompt (the
    model's own calls: test_builtin_agents.py)."""
    messages = [{"role": "user", "content": "Show setup.py"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "read_file", "arguments": json.dumps({"path": "setup.py"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "import setuptools\nsetuptools.setup()"}]
    r = oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    counted = an.messages.count_tokens(model=MODEL, tools=[{"name": "read_file", "input_schema": TOOLS[0][
        "function"]["parameters"], "description": "Read a text file."}], messages=[
        {"role": "user", "content": "Show setup.py"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "read_file",
                                           "input": {"path": "setup.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "import setuptools\nsetuptools.setup()"}]}])
    assert counted.input_tokens == r.usage.prompt_tokens     # both APIs render the same prompt


def test_anthropic_stream_event_order(an):
    greedy = {"temperature": 0}          # this SDK no longer has a temperature argument
    with an.messages.stream(model=MODEL, max_tokens=16, messages=ASK, extra_body=greedy) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and kinds.index("content_block_start") < kinds.index("content_block_stop")
    whole = an.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=greedy)
    assert final.content[0].text == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens
    assert whole.stop_reason in ("end_turn", "max_tokens")


def test_bad_input_battery_leaves_no_leak(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, (request, status) in CASES.items():
            if name == "oversize body":     # the default body limit (32 MiB) is not reached by it
                continue
            r = send(http, request)
            assert r.status_code == status, (name, r.text[:300])
            check_error_shape(r, request[1])
        assert http.get("/health").status_code == 200
    status = wait_idle(server.url)
    assert status["kv"]["leaked"] == 0 and status["kv"]["free"] + status["kv"]["prefix_cached"] == status["kv"]["slots"]


def test_eight_concurrent_clients_match_solo_runs(server):
    seeds = ["Write Python code.", "Write a Python function.", "Write Python code for a stack.",
             "Write a Python class.", "Write Python code to read a file.", "Write Python tests.",
             "Write a Python parser.", "Write Python code for sorting."]
    prompts = [[{"role": "user", "content": s}] for s in seeds]
    check_concurrent_streams(server.url, prompts, max_tokens=24, aborting={2, 5})


def test_metrics_after_traffic(server):
    text = httpx.get(server.url + "/metrics").text
    assert "freetoken_moe_hits_total" in text and "freetoken_generation_tokens_total" in text


def test_cache_status_returns_the_start_up_plan(server):
    plan = cache_status(server.url)["geometry"]["plan"]
    decisions = {d["name"]: d for d in plan["decisions"]}
    assert plan["compute"] == "cpu" and plan["moe_backend"] == decisions["moe backend"]["value"] == "cpu"
    assert plan["kv_tokens"] == cache_status(server.url)["kv"]["slots"]
    assert decisions["moe backend"]["why"].startswith("auto: no GPU") and all(d["why"] for d in plan["decisions"])


def test_a_bad_rebuild_is_a_400_naming_the_field(server):
    for body, field in (({"num_kv_tokens": 1}, "num_kv_tokens"), ({"moe_cache_size": 8}, "moe_cache_size")):
        r = httpx.post(server.url + "/v1/cache/rebuild", json=body, timeout=120)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_cache_rebuild_idle_and_under_traffic(server, oa):
    r = httpx.post(server.url + "/v1/cache/rebuild", json={"num_kv_tokens": 6144}, timeout=120)
    assert r.status_code == 200, r.text
    assert cache_status(server.url)["kv"]["slots"] == 6144
    assert cache_status(server.url)["geometry"]["plan"]["kv_tokens"] == 6144
    answers, codes = [], []

    def ask():
        answers.append(oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
                       .choices[0].message.content)
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
        codes.append(httpx.post(server.url + "/v1/cache/rebuild", json={"num_kv_tokens": 8192}, timeout=120)
                     .status_code)
    for t in threads:
        t.join(300)
    assert set(codes) <= {200, 409} and len(answers) == 4 and len(set(answers)) == 1
    status = wait_idle(server.url)
    assert status["kv"]["leaked"] == 0


def test_cached_tokens_reported(server, oa, an):
    """A repeated prompt reuses its prefix (all but the last token are recomputed at least)."""
    messages = [{"role": "user", "content": "Write Python code for a queue."}]
    first = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    again = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    m = an.messages.create(model=MODEL, max_tokens=4, messages=messages, extra_body={"temperature": 0})
    assert m.usage.cache_read_input_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == again.usage.prompt_tokens
    assert "freetoken_prefix_cache_hit_tokens_total 0\n" not in httpx.get(server.url + "/metrics").text
