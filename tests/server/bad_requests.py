"""The bad-input battery: malformed requests, each with the 4xx status it must get."""
from __future__ import annotations

M = "tiny-agent-moe"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return ("POST", "/v1/chat/completions", {"model": M, "messages": USER, **fields})


def msg(**fields):
    return ("POST", "/v1/messages", {"model": M, "max_tokens": 8, "messages": USER, **fields})


def raw(path: str, data: bytes, headers=None):
    return ("POST", path, data, headers or {"content-type": "application/json"})


def drop(request, key):
    method, path, body = request
    return (method, path, {k: v for k, v in body.items() if k != key})


LONG_PROMPT = "def f(x):\n    return x\n" * 800          # > 2048 tokens: beyond the demo context

CASES = {
    # body and JSON
    "invalid json": (raw("/v1/chat/completions", b'{"model": "x", '), 400),
    "empty body": (raw("/v1/chat/completions", b""), 400),
    "json array body": (raw("/v1/chat/completions", b"[1, 2]"), 400),
    "NaN literal": (raw("/v1/chat/completions", b'{"model": "%s", "messages": [], "temperature": NaN}' % M.encode()), 400),
    "invalid utf-8": (raw("/v1/chat/completions", b'{"model": "\xff\xfe"}'), 400),
    "deep nesting": (raw("/v1/chat/completions", b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}"), 400),
    "oversize body": (raw("/v1/chat/completions", b'{"model": "' + b"x" * (2 << 20) + b'"}'), 413),
    "text/plain body": (raw("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
                            % M.encode(), {"content-type": "text/plain"}), 415),
    "curl -d's form type": (raw("/v1/messages", b'{"model": "%s", "max_tokens": 8, "messages": []}' % M.encode(),
                                {"content-type": "application/x-www-form-urlencoded"}), 415),
    "tool result without tool_call_id": (chat(messages=USER + [{"role": "tool", "content": "42"}]), 400),
    "tool result for no call": (chat(messages=[
        *USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "42"}]), 400),
    "anthropic tool_result for no tool_use": (msg(messages=[
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "42"}]}]), 400),
    "responses without input": (("POST", "/v1/responses", {"model": M}), 400),
    "responses function_call_output for no call": (("POST", "/v1/responses", {"model": M, "input": [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_9", "output": "42"}]}), 400),
    # OpenAI chat fields
    "missing model": (drop(chat(), "model"), 400),
    "unknown model": (chat(model="gpt-9"), 404),
    "model not a string": (chat(model=7), 400),
    "missing messages": (drop(chat(), "messages"), 400),
    "empty messages": (chat(messages=[]), 400),
    "messages not a list": (chat(messages="hi"), 400),
    "message not an object": (chat(messages=["hi"]), 400),
    "message without role": (chat(messages=[{"content": "hi"}]), 400),
    "unknown role": (chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    "user without content": (chat(messages=[{"role": "user"}]), 400),
    "content is a number": (chat(messages=[{"role": "user", "content": 5}]), 400),
    "image content part": (chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400),
    "unknown message field": (chat(messages=[{"role": "user", "content": "hi", "mood": "happy"}]), 400),
    "legacy function_call": (chat(messages=[{"role": "assistant", "content": "",
                                             "function_call": {"name": "f", "arguments": "{}"}}]), 400),
    "tool call without function": (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "1"}]}]), 400),
    "negative max_tokens": (chat(max_tokens=-5), 400),
    "zero max_tokens": (chat(max_tokens=0), 400),
    "huge max_tokens": (chat(max_tokens=2**40), 400),
    "max_tokens as string": (chat(max_tokens="10"), 400),
    "max_tokens as bool": (chat(max_tokens=True), 400),
    "max_tokens as float": (chat(max_tokens=5.5), 400),
    "negative max_completion_tokens": (chat(max_completion_tokens=-1), 400),
    "negative temperature": (chat(temperature=-1), 400),
    "temperature too high": (chat(temperature=7), 400),
    "temperature as string": (chat(temperature="hot"), 400),
    "infinite temperature": (raw("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", '
                                 b'"content": "hi"}], "temperature": 1e999}' % M.encode()), 400),
    "top_p zero": (chat(top_p=0), 400),
    "top_p above one": (chat(top_p=1.5), 400),
    "top_k below -1": (chat(top_k=-5), 400),
    "min_p above one": (chat(min_p=2), 400),
    "negative seed": (chat(seed=-1), 400),
    "huge seed": (chat(seed=2**70), 400),
    "n = 0": (chat(n=0), 400),
    "n above the limit": (chat(n=17), 400),
    "presence penalty out of range": (chat(presence_penalty=2.5), 400),
    "frequency penalty as string": (chat(frequency_penalty="lots"), 400),
    "repetition penalty zero": (chat(repetition_penalty=0), 400),
    "top_logprobs without logprobs": (chat(top_logprobs=3), 400),
    "top_logprobs above 20": (chat(logprobs=True, top_logprobs=21), 400),
    "logprobs as number on chat": (chat(logprobs=2), 400),
    "logit_bias key not a token id": (chat(logit_bias={"abc": 5}), 400),
    "logit_bias value out of range": (chat(logit_bias={"1": 500}), 400),
    "logit_bias token beyond the vocabulary": (chat(logit_bias={"99999999": 1}), 400),
    "logit_bias not an object": (chat(logit_bias=[1, 2]), 400),
    "response_format of unknown type": (chat(response_format={"type": "xml"}), 400),
    "json_schema response_format without json_schema": (chat(response_format={"type": "json_schema"}), 400),
    "response_format schema not an object": (chat(response_format={"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": 5}}), 400),
    "stop as number": (chat(stop=5), 400),
    "too many stop strings": (chat(stop=[f"s{i}" for i in range(17)]), 400),
    "unknown field": (chat(frobnicate=True), 400),
    "stream as string": (chat(stream="yes"), 400),
    "stream_options field type": (chat(stream=True, stream_options={"include_usage": "yes"}), 400),
    "tools not a list": (chat(tools={"type": "function"}), 400),
    "tool without name": (chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400),
    "tool of unknown type": (chat(tools=[{"type": "code_interpreter"}]), 400),
    "tool parameters not a JSON Schema": (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]), 400),
    "tool parameters not an object": (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), 400),
    "anthropic input_schema not a JSON Schema": (msg(tools=[{"name": "f", "input_schema": {"required": "a"}}]), 400),
    "responses tool parameters not a JSON Schema": (("POST", "/v1/responses", {"model": M, "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": 5}}]}), 400),
    "tool_choice names a missing tool": (chat(tool_choice={"type": "function", "function": {"name": "nope"}}), 400),
    "tool_choice bad string": (chat(tool_choice="sometimes"), 400),
    "template kwargs override messages": (chat(chat_template_kwargs={"messages": []}), 400),
    "reasoning_effort bad": (chat(reasoning_effort="extreme"), 400),
    "prompt beyond the context": (chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400),
    # OpenAI completions
    "completions prompt batch with a bad item": (("POST", "/v1/completions", {"model": M, "prompt": ["a", 5]}), 400),
    "completions too many sequences": (("POST", "/v1/completions", {"model": M, "prompt": ["a"] * 20, "n": 16}), 400),
    "completions token id out of range": (("POST", "/v1/completions", {"model": M, "prompt": [1, 10**9]}), 400),
    "completions max_tokens 0 without echo": (("POST", "/v1/completions", {"model": M, "prompt": "a",
                                                                         "max_tokens": 0}), 400),
    "completions logprobs above 20": (("POST", "/v1/completions", {"model": M, "prompt": "a", "logprobs": 21}), 400),
    "completions echo as string": (("POST", "/v1/completions", {"model": M, "prompt": "a", "echo": "yes"}), 400),
    "completions empty prompt": (("POST", "/v1/completions", {"model": M, "prompt": ""}), 400),
    "completions missing prompt": (("POST", "/v1/completions", {"model": M}), 400),
    # Anthropic
    "anthropic missing max_tokens": (drop(msg(), "max_tokens"), 400),
    "anthropic unknown model": (msg(model="claude-opus-9"), 404),
    "anthropic temperature above one": (msg(temperature=1.5), 400),
    "anthropic system as number": (msg(system=3), 400),
    "anthropic role tool in messages": (msg(messages=[{"role": "tool", "content": "x"}]), 400),
    "anthropic image block": (msg(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400),
    "anthropic unknown block": (msg(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), 400),
    "anthropic tool_result without id": (msg(messages=[{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]), 400),
    "anthropic tool_use without name": (msg(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "input": {}}]}]), 400),
    "anthropic server tool": (msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400),
    "anthropic tool_choice tool without name": (msg(tools=[{"name": "f", "input_schema": {}}],
                                                    tool_choice={"type": "tool"}), 400),
    "anthropic thinking bad type": (msg(thinking={"type": "maybe"}), 400),
    "anthropic stop_sequences not a list": (msg(stop_sequences={"a": 1}), 400),
    "anthropic output format without schema": (msg(output_config={"format": {"type": "json_schema"}}), 400),
    "anthropic output format json_object": (msg(output_format={"type": "json_object"}), 400),
    "anthropic clear_thinking keep bad": (msg(context_management={"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": -1}}]}), 400),
    "anthropic beyond the context": (msg(messages=[{"role": "user", "content": LONG_PROMPT}]), 400),
    "anthropic count_tokens without messages": (("POST", "/v1/messages/count_tokens", {"model": M}), 400),
    # routes and methods
    "unknown route": (("POST", "/v1/nothing", {}), 404),
    "wrong method": (("GET", "/v1/chat/completions", None), 405),
    "rebuild without sizes": (("POST", "/v1/cache/rebuild", {}), 400),
    "rebuild negative size": (("POST", "/v1/cache/rebuild", {"num_kv_tokens": -3}), 400),
    "rebuild unknown field": (("POST", "/v1/cache/rebuild", {"pages": 3}), 400),
}


def send(client, request):
    """Send one case with an httpx client; returns the response."""
    method, path, body, *headers = request
    # One connection per case: after an error the server may close a kept-alive connection
    # (e.g. a body it refused to read), and a pooled client would then reuse a dead socket.
    headers = {**(headers[0] if headers else {}), "Connection": "close"}
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers=headers)
    return client.request(method, path, json=body, headers=headers)


def check_error_shape(response, path: str) -> None:
    data = response.json()
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    else:
        assert {"message", "type", "param", "code"} <= set(data["error"]), data
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
