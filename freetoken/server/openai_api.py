"""OpenAI routes: /v1/chat/completions and /v1/models (JSON and SSE shapes); /v1/completions
lives in openai_completions.py and shares this module's helpers."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dataclasses import replace

from freetoken.server import openai_fields as fields
from freetoken.server import sse
from freetoken.server.body import read_json
from freetoken.server.errors import APIError, error_body
from freetoken.server.choices import collect_all, fan_out, merged, total_usage
from freetoken.server.generation import (Done, GenerationError, Generation, Logprobs, Ping, Reasoning, Text,
                                         ToolCall, Usage, cancel_on_disconnect, chat_spec)
from freetoken.server.logprobs import TokenText, chat_logprobs
from freetoken.server.messages import openai_conversation
from freetoken.server.protocol import (Body, constrained, effort_kwargs, json_format_grammar, sampling, stop_strings,
                                       speaks_harmony, template_kwargs, tool_choice_grammar)
from freetoken.server.state import new_id

COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                 "seed", "stop", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logprobs", "top_logprobs", "logit_bias", "user", "metadata", "store", "service_tier",
                 "safety_identifier", "prompt_cache_key", "ignore_eos", "priority"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                               "response_format", "reasoning_effort", "chat_template_kwargs", "modalities",
                               "verbosity", "prompt_cache_options", "prompt_cache_retention", "moderation",
                               "audio", "prediction", "functions", "function_call", "web_search_options"}


async def chat_completions(request: Request) -> Response:
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    body.only(CHAT_FIELDS)
    _common(body, state)
    grammar, what = _response_format(body, speaks_harmony(state))
    body.default_only("modalities", (["text"],), "other than [\"text\"] is not supported")
    body.bool("parallel_tool_calls", None)
    for key in ("audio", "prediction", "functions", "function_call", "web_search_options"):
        body.default_only(key, (), "is not supported")
    conv = openai_conversation(body)
    effort = body.str("reasoning_effort", None, choices=("none", "minimal", "low", "medium", "high", "xhigh"))
    kwargs = effort_kwargs(template_kwargs(body), effort)
    max_tokens = body.int("max_completion_tokens", None, lo=1)
    max_tokens = max_tokens if max_tokens is not None else body.int("max_tokens", None, lo=1)
    params = sampling(body, state.limits(), max_tokens=max_tokens, stop=stop_strings(body, "stop"),
                      temperature_max=2.0)
    params = fields.with_penalties(body, replace(params, logprobs=fields.chat_logprobs(body)),
                                   state.ready_engine().tokenizer.vocab_size)
    if grammar is None:
        grammar, what = tool_choice_grammar(state, conv, body.data.get("parallel_tool_calls") is not False)
    params = constrained(params, grammar, what, what.split()[0])
    stream, include_usage = _stream_flags(body)
    spec = await chat_spec(state, conv, params, kwargs, max_tokens_given=max_tokens is not None)
    gens = fan_out(state, spec, "/v1/chat/completions", new_id("chatcmpl-"), fields.choices(body))
    head = {"id": gens[0].rid, "created": int(time.time()), "model": body.data["model"], "system_fingerprint": None}
    text = TokenText(state.ready_engine().tokenizer)
    if stream:
        return sse.response(_chat_frames(gens, head, include_usage, text))
    results = await collect(request, gens)
    if results is None:
        return Response(status_code=499)
    choices = [_chat_choice(i, r, text, params.logprobs is not None) for i, r in enumerate(results)]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": usage(total_usage([r.done.usage for r in results]))})


def _chat_choice(index: int, result, text: TokenText, logprobs: bool) -> dict:
    message = {"role": "assistant", "content": result.text or (None if result.calls else "")}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.calls:
        message["tool_calls"] = [_call(c) for c in result.calls]
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(text, result.logprobs) if logprobs else None,
            "finish_reason": result.done.finish_reason}


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
    for key in ("user", "service_tier", "safety_identifier", "prompt_cache_key"):
        body.str(key, None)
    body.obj("metadata", None)
    body.bool("store", None)
    body.default_only("priority", (0,), fields.PRIORITY_REFUSED)


def _response_format(body: Body, harmony: bool) -> tuple[str | None, str]:
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
    return json_format_grammar(kind, schema, harmony), f"response_format {kind}"


def _stream_flags(body: Body) -> tuple[bool, bool]:
    stream = body.bool("stream", False)
    options = body.obj("stream_options", None)
    if options is None:
        return stream, False
    options.only({"include_usage", "include_obfuscation"})
    options.bool("include_obfuscation", None)
    return stream, options.bool("include_usage", False)


async def collect(request: Request, gens: list[Generation]):
    """Every choice's Collected, or None when the client went away first."""
    try:
        return await cancel_on_disconnect(request, collect_all(gens))
    except GenerationError as e:
        raise APIError(400 if e.invalid else 500, str(e)) from None


def _call(c: ToolCall) -> dict:
    return {"id": new_id("call_"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def error_frame(e: GenerationError) -> str:
    return sse.data(error_body(APIError(400 if e.invalid else 500, str(e)), "openai"))


async def _chat_frames(gens: list[Generation], head: dict, include_usage: bool, text: TokenText):
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    usages = []

    def chunk(i: int, delta: dict, finish=None, logprobs=None) -> str:
        return sse.data({**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}], **extra})
    for i in range(len(gens)):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for i, ev in merged(gens):
            if isinstance(ev, Text):
                yield chunk(i, {"content": ev.text})
            elif isinstance(ev, Reasoning):
                yield chunk(i, {"reasoning_content": ev.text})
            elif isinstance(ev, ToolCall):
                yield chunk(i, {"tool_calls": [{"index": ev.index, **_call(ev)}]})
            elif isinstance(ev, Logprobs):        # the tokens of the deltas that follow
                yield chunk(i, {}, logprobs=chat_logprobs(text, ev.entries))
            elif isinstance(ev, Ping):
                yield sse.OPENAI_PING
            elif isinstance(ev, Done):
                usages.append(ev.usage)
                yield chunk(i, {}, ev.finish_reason)
    except GenerationError as e:
        yield error_frame(e)
        return
    if include_usage:
        yield sse.data({**base, "choices": [], "usage": usage(total_usage(usages))})
    yield "data: [DONE]\n\n"
