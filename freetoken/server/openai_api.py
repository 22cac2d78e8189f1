"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models (JSON and SSE shapes)."""
from __future__ import annotations

import time

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.server import sse
from freetoken.server.body import read_json
from freetoken.server.errors import APIError, error_body
from freetoken.server.generation import (Done, GenerationError, GenSpec, Generation, Ping, Reasoning, Text,
                                         ToolCall, Usage, cancel_on_disconnect, chat_spec, check_prompt)
from freetoken.server.messages import openai_conversation
from freetoken.server.protocol import (Body, constrained, json_format_grammar, sampling, stop_strings,
                                       template_kwargs, tool_choice_grammar)
from freetoken.server.state import new_id

COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                 "seed", "stop", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logprobs", "top_logprobs", "logit_bias", "user", "metadata", "store", "service_tier",
                 "safety_identifier", "prompt_cache_key", "ignore_eos"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                               "response_format", "reasoning_effort", "chat_template_kwargs", "modalities",
                               "verbosity", "prompt_cache_options", "prompt_cache_retention", "moderation",
                               "audio", "prediction", "functions", "function_call", "web_search_options"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
LEGACY_MAX_TOKENS = 16       # /v1/completions' documented default


async def chat_completions(request: Request) -> Response:
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    body.only(CHAT_FIELDS)
    _common(body, state)
    grammar, what = _response_format(body)
    body.default_only("modalities", (["text"],), "other than [\"text\"] is not supported")
    body.bool("parallel_tool_calls", None)
    for key in ("audio", "prediction", "functions", "function_call", "web_search_options"):
        body.default_only(key, (), "is not supported")
    conv = openai_conversation(body)
    kwargs = template_kwargs(body)
    effort = body.str("reasoning_effort", None, choices=("none", "minimal", "low", "medium", "high", "xhigh"))
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    max_tokens = body.int("max_completion_tokens", None, lo=1)
    max_tokens = max_tokens if max_tokens is not None else body.int("max_tokens", None, lo=1)
    params = sampling(body, state.limits(), max_tokens=max_tokens, stop=stop_strings(body, "stop"),
                      temperature_max=2.0)
    if grammar is None:
        grammar, what = tool_choice_grammar(state, conv, body.data.get("parallel_tool_calls") is not False)
    params = constrained(params, grammar, what, what.split()[0])
    stream, include_usage = _stream_flags(body)
    spec = await chat_spec(state, conv, params, kwargs, max_tokens_given=max_tokens is not None)
    gen = Generation(state, spec, "/v1/chat/completions", new_id("chatcmpl-"))
    head = {"id": gen.rid, "created": int(time.time()), "model": body.data["model"], "system_fingerprint": None}
    if stream:
        return sse.response(_chat_frames(gen, head, include_usage))
    result = await _collect(request, gen)
    if result is None:
        return Response(status_code=499)
    message = {"role": "assistant", "content": result.text or (None if result.calls else "")}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.calls:
        message["tool_calls"] = [_call(c) for c in result.calls]
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": result.done.finish_reason}
    return JSONResponse({**head, "object": "chat.completion", "choices": [choice],
                         "usage": usage(result.done.usage)})


async def completions(request: Request) -> Response:
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    body.only(COMPLETION_FIELDS)
    _common(body, state)
    body.default_only("echo", (False,))
    body.default_only("suffix", ("",))
    body.default_only("best_of", (1,), "other than 1 is not supported")
    params = sampling(body, state.limits(LEGACY_MAX_TOKENS), max_tokens=body.int("max_tokens", None, lo=1),
                      stop=stop_strings(body, "stop"), temperature_max=2.0)
    stream, include_usage = _stream_flags(body)
    engine = state.ready_engine()
    ids = await _prompt_ids(body, engine.tokenizer)
    params = check_prompt(engine, ids, params, max_tokens_given=body.has("max_tokens"))
    gen = Generation(state, GenSpec(ids, params), "/v1/completions", new_id("cmpl-"))
    head = {"id": gen.rid, "object": "text_completion", "created": int(time.time()), "model": body.data["model"]}
    if stream:
        return sse.response(_completion_frames(gen, head, include_usage))
    result = await _collect(request, gen)
    if result is None:
        return Response(status_code=499)
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.done.finish_reason}
    return JSONResponse({**head, "choices": [choice], "usage": usage(result.done.usage)})


async def models(request: Request) -> Response:
    state = request.app.state.server
    return JSONResponse({"object": "list", "data": [_card(state, name) for name in state.names]})


async def model(request: Request) -> Response:
    """GET /v1/models/{id} (the SDKs' models.retrieve): the card, or 404 model_not_found."""
    state = request.app.state.server
    name = request.path_params["model"]
    state.check_model(name)
    return JSONResponse(_card(state, name))


def _card(state, name: str) -> dict:
    ctx = state.context_length
    return {"id": name, "object": "model", "created": int(state.started), "owned_by": "freetoken",
            "root": state.model_dir.name, "max_model_len": ctx, "context_length": ctx}


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _common(body: Body, state) -> None:
    state.check_model(body.str("model", nonempty=True))
    body.default_only("n", (1,), "other than 1 is not supported")
    for key in ("presence_penalty", "frequency_penalty"):
        body.default_only(key, (0,), "other than 0 is not supported")
    body.default_only("repetition_penalty", (1,), "other than 1 is not supported")
    body.default_only("logprobs", (False, 0), "is not supported")
    body.default_only("top_logprobs", (0,), "is not supported")
    body.default_only("logit_bias", ({},), "is not supported")
    for key in ("user", "service_tier", "safety_identifier", "prompt_cache_key"):
        body.str(key, None)
    body.obj("metadata", None)
    body.bool("store", None)


def _response_format(body: Body) -> tuple[str | None, str]:
    """(the grammar of `response_format`, or None for text; its description for errors)."""
    fmt = body.obj("response_format", None)
    if fmt is None:
        return None, "response_format"
    kind = fmt.str("type", choices=("text", "json_object", "json_schema"))
    schema = None
    if kind == "json_schema":
        fmt.only({"type", "json_schema"})
        spec = fmt.obj("json_schema")
        spec.only({"name", "schema", "description", "strict"})
        spec.str("name", nonempty=True, max_len=64)
        spec.str("description", None)
        spec.bool("strict", None)
        given = spec.obj("schema", None)
        schema = None if given is None else given.data
    else:
        fmt.only({"type"})
    return json_format_grammar(kind, schema), f"response_format {kind}"


def _stream_flags(body: Body) -> tuple[bool, bool]:
    stream = body.bool("stream", False)
    options = body.obj("stream_options", None)
    if options is None:
        return stream, False
    options.only({"include_usage", "include_obfuscation"})
    options.bool("include_obfuscation", None)
    return stream, options.bool("include_usage", False)


async def _prompt_ids(body: Body, tokenizer) -> list[int]:
    """A string, a one-item list of strings, or token ids (flat or a one-item list of lists)."""
    prompt = body.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await anyio.to_thread.run_sync(tokenizer.encode, prompt)
    vocab = tokenizer.vocab_size
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocab for t in prompt):
        return list(prompt)
    raise APIError(400, f"prompt must be a string or a non-empty list of token ids in [0, {vocab}) "
                        "(one prompt per request)", param="prompt")


async def _collect(request: Request, gen: Generation):
    try:
        return await cancel_on_disconnect(request, gen.collect())
    except GenerationError as e:
        raise APIError(400 if e.invalid else 500, str(e)) from None


def _call(c: ToolCall) -> dict:
    return {"id": new_id("call_"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _error_frame(e: GenerationError) -> str:
    return sse.data(error_body(APIError(400 if e.invalid else 500, str(e)), "openai"))


async def _chat_frames(gen: Generation, head: dict, include_usage: bool):
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish=None) -> str:
        return sse.data({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}], **extra})
    yield chunk({"role": "assistant", "content": ""})
    try:
        async for ev in gen.events():
            if isinstance(ev, Text):
                yield chunk({"content": ev.text})
            elif isinstance(ev, Reasoning):
                yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCall):
                yield chunk({"tool_calls": [{"index": ev.index, **_call(ev)}]})
            elif isinstance(ev, Ping):
                yield sse.OPENAI_PING
            elif isinstance(ev, Done):
                yield chunk({}, ev.finish_reason)
                if include_usage:
                    yield sse.data({**base, "choices": [], "usage": usage(ev.usage)})
    except GenerationError as e:
        yield _error_frame(e)
        return
    yield "data: [DONE]\n\n"


async def _completion_frames(gen: Generation, head: dict, include_usage: bool):
    extra = {"usage": None} if include_usage else {}
    try:
        async for ev in gen.events():
            if isinstance(ev, Text):
                yield sse.data({**head, "choices": [{"index": 0, "text": ev.text, "logprobs": None,
                                                     "finish_reason": None}], **extra})
            elif isinstance(ev, Ping):
                yield sse.OPENAI_PING
            elif isinstance(ev, Done):
                yield sse.data({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                     "finish_reason": ev.finish_reason}], **extra})
                if include_usage:
                    yield sse.data({**head, "choices": [], "usage": usage(ev.usage)})
    except GenerationError as e:
        yield _error_frame(e)
        return
    yield "data: [DONE]\n\n"
