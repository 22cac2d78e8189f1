"""Anthropic routes: /v1/messages (JSON and the full SSE event sequence), /v1/messages/count_tokens."""
from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.log import logger
from freetoken.server import sse
from freetoken.server.anthropic_messages import anthropic_conversation
from freetoken.server.body import read_json
from freetoken.server.errors import APIError, error_body
from freetoken.server.generation import (Done, Generation, GenerationError, Ping, Reasoning, Text, ToolCall,
                                         Usage, cancel_on_disconnect, chat_spec)
from freetoken.server.protocol import (Body, constrained, effort_kwargs, json_format_grammar, sampling, stop_strings,
                                       speaks_harmony, template_kwargs, tool_choice_grammar)
from freetoken.server.state import new_id

# fields that mean something here; everything else a request carries is logged (DEBUG) and ignored,
# as harnesses add fields with each release (Claude Code 2.1 sends context_management, output_config)
KNOWN_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "chat_template_kwargs",
                "output_format", "output_config", "context_management", "mcp_servers", "max_tokens",
                "stop_sequences", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos"}
WHY_IGNORED = {"metadata": "accounting for Anthropic's service",
               "cache_control": "the prefix cache reuses repeated prefixes by itself",
               "service_tier": "one local engine", "inference_geo": "one local engine",
               "container": "no code-execution container"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


async def messages(request: Request) -> Response:
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    conv, kwargs, fmt = _conversation(body, state, "/v1/messages")
    params = sampling(body, state.limits(), max_tokens=body.int("max_tokens", lo=1),
                      stop=stop_strings(body, "stop_sequences"), temperature_max=1.0)
    params = constrained(params, *_grammar(body, state, conv, fmt))
    stream = body.bool("stream", False)
    spec = await chat_spec(state, conv, params, kwargs, max_tokens_given=True)
    gen = Generation(state, spec, "/v1/messages", new_id("msg_"))
    head = {"id": gen.rid, "type": "message", "role": "assistant", "model": body.data["model"]}
    if stream:
        return sse.response(_frames(gen, head, len(spec.prompt_ids)))
    try:
        result = await cancel_on_disconnect(request, gen.collect())
    except GenerationError as e:
        raise APIError(400 if e.invalid else 500, str(e)) from None
    if result is None:
        return Response(status_code=499)
    content = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text:
        content.append({"type": "text", "text": result.text})
    content += [_tool_use(c) for c in result.calls]
    reason, stop_sequence = _stop(result.done)
    return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
                         "usage": usage(result.done.usage)})


async def count_tokens(request: Request) -> Response:
    """The prompt's token count, whatever its length: clients count to decide when to compact."""
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    conv, kwargs, _ = _conversation(body, state, "/v1/messages/count_tokens")
    params = sampling(Body({}), state.limits(), max_tokens=1, stop=(), temperature_max=1.0)
    spec = await chat_spec(state, conv, params, kwargs, check=False)
    return JSONResponse({"input_tokens": len(spec.prompt_ids)})


def usage(u: Usage) -> dict:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens computed anew."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _conversation(body: Body, state, route: str):
    state.check_model(body.str("model", nonempty=True))
    _log_ignored(body, route)
    fmt = _output_format(body)
    body.default_only("mcp_servers", ([],), "(the MCP connector) is not supported; run MCP servers in the client")
    conv = anthropic_conversation(body)
    kwargs = template_kwargs(body)
    if body.has("output_config"):
        config = body.obj("output_config")
        effort = config.data.get("effort")
        if isinstance(effort, str) and speaks_harmony(state):
            effort_kwargs(kwargs, effort)         # gpt-oss's template reads it as reasoning_effort
        elif config.has("effort"):
            logger.debug("%s: output_config.effort %r ignored (no effort control)", route, effort)
    if body.has("thinking"):
        thinking = body.obj("thinking")
        kind = thinking.str("type", choices=("enabled", "disabled", "adaptive"))
        if thinking.int("budget_tokens", None, lo=0) is not None:
            logger.debug("%s: thinking.budget_tokens ignored (no thinking budget is enforced)", route)
        kwargs.setdefault("enable_thinking", kind != "disabled")    # the template's thinking switch
    return conv, kwargs, fmt


def _output_format(body: Body) -> tuple[dict | None, str]:
    """(the JSON schema structured output asks for, or None; the field that asked):
    ``output_config.format``, or the older beta's top-level ``output_format``, both
    ``{"type": "json_schema", "schema": {...}}``."""
    config = body.obj("output_config", None)
    given = [b.obj(key) for b, key in ((config, "format"), (body, "output_format")) if b is not None and b.has(key)]
    if not given:
        return None, ""
    if len(given) > 1:
        raise APIError(400, "give output_config.format or output_format (the older beta's name), not both",
                       param="output_format")
    given[0].str("type", choices=("json_schema",))
    return given[0].obj("schema").data, given[0].path


def _grammar(body: Body, state, conv, fmt: tuple[dict | None, str]) -> tuple[str | None, str, str]:
    """(grammar, what, param) for ``constrained``: the format's, or tool_choice any / tool's. A
    forced tool choice wins over a format: its output is a tool_use block, which no format
    governs, while JSON text would break the forced call."""
    choice = body.data.get("tool_choice") or {}
    grammar, what = tool_choice_grammar(state, conv, not choice.get("disable_parallel_tool_use", False))
    schema, where = fmt
    if schema is None:
        return grammar, what, what
    if conv.tools and conv.choice not in ("auto", "none"):
        logger.debug("/v1/messages: %s not enforced: tool_choice forces a tool call", where)
        return grammar, what, what
    return json_format_grammar("json_schema", schema, speaks_harmony(state)), f"{where} json_schema", where


def _log_ignored(body: Body, route: str) -> None:
    for key, value in body.data.items():
        if key not in KNOWN_FIELDS and value is not None:
            logger.debug("%s: %s ignored (%s)", route, key, WHY_IGNORED.get(key, "not used by this server"))
    if _marks_cache(body.data):
        logger.debug("%s: cache_control ignored (%s)", route, WHY_IGNORED["cache_control"])


def _marks_cache(data: dict) -> bool:
    """Whether any system, tool or message block carries cache_control (a prompt-caching hint)."""
    blocks = [*_dicts(data.get("system")), *_dicts(data.get("tools"))]
    for m in _dicts(data.get("messages")):
        blocks += _dicts(m.get("content"))
    return any("cache_control" in b for b in blocks)


def _dicts(value) -> list[dict]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _stop(done: Done) -> tuple[str, str | None]:
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return STOP_REASONS.get(done.finish_reason, "end_turn"), None


def _tool_use(c: ToolCall, with_input: bool = True) -> dict:
    return {"type": "tool_use", "id": new_id("toolu_"), "name": c.name,
            "input": json.loads(c.arguments) if with_input else {}}


class _Blocks:
    """Content-block bookkeeping for the stream: a new block whenever the kind changes."""

    def __init__(self):
        self.index, self.kind = -1, None

    def open(self, kind: str, block: dict) -> list[str]:
        if self.kind == kind and kind != "tool_use":
            return []
        frames = self.close()
        self.index, self.kind = self.index + 1, kind
        frames.append(sse.event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block}))
        return frames

    def delta(self, delta: dict) -> str:
        return sse.event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                 "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _event_frames(ev, blocks: _Blocks) -> list[str]:
    if isinstance(ev, Text):
        return blocks.open("text", {"type": "text", "text": ""}) + [
            blocks.delta({"type": "text_delta", "text": ev.text})]
    if isinstance(ev, Reasoning):
        return blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + [
            blocks.delta({"type": "thinking_delta", "thinking": ev.text})]
    if isinstance(ev, ToolCall):
        return blocks.open("tool_use", _tool_use(ev, with_input=False)) + [
            blocks.delta({"type": "input_json_delta", "partial_json": ev.arguments})] + blocks.close()
    if isinstance(ev, Ping):
        return [sse.event("ping", {"type": "ping"})]
    reason, stop_sequence = _stop(ev)
    return blocks.close() + [
        sse.event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                    "usage": usage(ev.usage)}),
        sse.event("message_stop", {"type": "message_stop"})]


async def _frames(gen: Generation, head: dict, prompt_tokens: int):
    def start() -> str:
        # sent with the first output, once the prefix cache was consulted: its usage then agrees
        # with message_delta's (input_tokens are the tokens computed anew, cache reads apart)
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": usage(Usage(prompt_tokens, 0, gen.cached_tokens))}
        return sse.event("message_start", {"type": "message_start", "message": start})
    blocks, started = _Blocks(), False
    try:
        async for ev in gen.events():
            if not started and isinstance(ev, Ping):
                yield sse.OPENAI_PING       # an SSE comment: no event may precede message_start
                continue
            if not started:
                started = True
                yield start()
            for frame in _event_frames(ev, blocks):
                yield frame
    except GenerationError as e:
        body = error_body(APIError(400 if e.invalid else 500, str(e)), "anthropic")
        yield (start() if not started else "") + sse.event("error", body)
