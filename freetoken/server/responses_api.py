"""POST /v1/responses: the OpenAI Responses API, as JSON or as the typed SSE event stream.

The request becomes the neutral conversation (responses_items.py), runs through the shared
generation layer, and its events become output items (responses_output.py). Stored responses
(`store` defaults to true) keep their conversation in a bounded in-memory LRU, so that
`previous_response_id` can continue them.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from freetoken.log import logger
from freetoken.server import openai_fields as fields
from freetoken.server import sse
from freetoken.server.body import read_json
from freetoken.server.errors import APIError
from freetoken.server.generation import Done, Generation, GenerationError, Ping, cancel_on_disconnect, chat_spec
from freetoken.server.logprobs import TokenText
from freetoken.server.messages import Conversation, check_tool_results
from freetoken.server.protocol import (Body, constrained, effort_kwargs, json_format_grammar, sampling, template_kwargs,
                                       speaks_harmony, tool_choice_grammar)
from freetoken.server.responses_items import (ResponseStore, function_tools, input_messages, items_messages,
                                              tool_choice, with_instructions)
from freetoken.server.responses_output import Output, usage
from freetoken.server.state import new_id

# accepted and ignored: accounting, caching and placement hints for OpenAI's own service
IGNORED_FIELDS = {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                  "service_tier", "client_metadata", "moderation", "metadata", "max_tool_calls", "include"}
# known, but only at the value that changes nothing
REFUSED = {"background": ((False,), "is not supported: a response runs within its request"),
           "conversation": ((), "is not supported; continue with previous_response_id"),
           "prompt": ((), "(prompt templates) is not supported"),
           "truncation": (("disabled",), "other than 'disabled' is not supported: prompts are never truncated"),
           "image": ((), "is not supported"), "access_programs": ((), "is not supported"),
           "background_options": ((), "is not supported"), "context_management": ((), "is not supported"),
           "priority": ((0,), fields.PRIORITY_REFUSED)}     # vLLM's; gateways (SMG) send 0
FIELDS = IGNORED_FIELDS | set(REFUSED) | {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "text", "reasoning", "store", "stream", "stream_options", "previous_response_id",
    "top_logprobs", "top_k", "min_p", "seed", "ignore_eos", "chat_template_kwargs",   # the last six: extensions
    "repetition_penalty"}
# no-ops here: reasoning travels as plain reasoning_text content, and no hosted tool ever runs
LOGPROBS = "message.output_text.logprobs"
INCLUDE = {LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url", "computer_call_output.output.image_url",
           "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
           "code_interpreter_call.outputs"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")


@dataclass
class _Plan:
    rid: str
    head: dict                   # the response fields that echo the request
    history: list[dict]          # the conversation so far without instructions: what a stored response keeps
    conv: Conversation
    params: SamplingParams
    kwargs: dict
    stream: bool
    store: bool
    warning: str | None          # said in a response header and the log


async def responses(request: Request) -> Response:
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    body.only(FIELDS)
    store = _store(request)
    plan = _plan(body, state, store, new_id("resp_"))
    spec = await chat_spec(state, plan.conv, plan.params, plan.kwargs,
                           max_tokens_given=body.has("max_output_tokens"))
    run = _Run(plan, Generation(state, spec, "/v1/responses", plan.rid), store, state.ready_engine().tokenizer)
    if plan.stream:
        response = sse.response(run.frames())
    else:
        result = await cancel_on_disconnect(request, run.collect())
        if result is None:
            return Response(status_code=499)
        response = JSONResponse(result)
    if plan.warning:
        response.headers["x-freetoken-warning"] = plan.warning
    return response


def _store(request: Request) -> ResponseStore:
    """One store per app (tests run several servers in one process)."""
    store = getattr(request.app.state, "responses", None)
    if store is None:
        store = request.app.state.responses = ResponseStore()
    return store


def _plan(body: Body, state, store: ResponseStore, rid: str) -> _Plan:
    model = body.str("model", nonempty=True)
    state.check_model(model)
    _check_fields(body)
    kwargs = template_kwargs(body)
    reasoning = _reasoning(body, kwargs)
    text, note, warning, grammar = _text_format(body, rid, speaks_harmony(state))
    tools, tools_echo = function_tools(body, rid)
    choice = tool_choice(body, tools)
    history = _history(body, store)
    instructions = body.str("instructions", None)
    system = "\n\n".join(s for s in (instructions, note) if s)
    params = sampling(body, state.limits(), max_tokens=body.int("max_output_tokens", None, lo=1), stop=(),
                      temperature_max=2.0)
    # FIELDS lets only repetition_penalty of the chat penalties through; the others stay at their defaults
    params = fields.with_penalties(body, replace(params, logprobs=_logprobs(body)),
                                   state.ready_engine().tokenizer.vocab_size)
    what = f"text.format {text['format']['type']}"
    if grammar is None:
        grammar, what = tool_choice_grammar(state, Conversation([], tools, choice),
                                            body.data.get("parallel_tool_calls") is not False)
    params = constrained(params, grammar, what, what.split()[0])
    stored = body.bool("store", True)
    head = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": instructions, "max_output_tokens": body.data.get("max_output_tokens"),
            "max_tool_calls": body.data.get("max_tool_calls"), "metadata": body.data.get("metadata") or {},
            "parallel_tool_calls": body.bool("parallel_tool_calls", True),
            "previous_response_id": body.data.get("previous_response_id"), "reasoning": reasoning,
            "store": stored, "temperature": params.temperature, "text": text,
            "tool_choice": body.data.get("tool_choice") or "auto", "tools": tools_echo, "top_p": params.top_p,
            "truncation": "disabled", "background": False, "service_tier": "default",
            "top_logprobs": body.data.get("top_logprobs") or 0,
            "user": body.data.get("user"), "prompt_cache_key": body.data.get("prompt_cache_key"),
            "safety_identifier": body.data.get("safety_identifier")}
    return _Plan(rid, head, history, Conversation(with_instructions(system, history), tools, choice), params,
                 kwargs, _stream(body), stored, warning)


def _check_fields(body: Body) -> None:
    for key, (defaults, why) in REFUSED.items():
        body.default_only(key, defaults, why)
    for key in ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"):
        body.str(key, None)
    for key in ("metadata", "client_metadata", "prompt_cache_options"):
        body.obj(key, None)
    body.int("max_tool_calls", None, lo=0)
    for i, value in enumerate(body.list("include", None) or ()):
        if value not in INCLUDE:
            raise APIError(400, f"include[{i}] is not a known value", param=f"include[{i}]")


def _logprobs(body: Body) -> int | None:
    """Top logprobs per output token when `include` asks for them (or top_logprobs > 0)."""
    top = body.int("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    return top if top or LOGPROBS in (body.data.get("include") or ()) else None


def _stream(body: Body) -> bool:
    stream = body.bool("stream", False)
    options = body.obj("stream_options", None)
    if options is not None:
        options.only({"include_obfuscation"})
        options.bool("include_obfuscation", None)
    return stream


def _reasoning(body: Body, kwargs: dict) -> dict:
    """The effort reaches the template (protocol.effort_kwargs: none as enable_thinking=false, gpt-oss's
    reasoning_effort); no summaries are generated."""
    if not body.has("reasoning"):
        return {"effort": None, "summary": None}
    r = body.obj("reasoning")
    r.only({"effort", "summary", "generate_summary", "context", "mode"})
    effort = r.str("effort", None, choices=EFFORTS)
    summary = r.str("summary", None, choices=SUMMARIES) or r.str("generate_summary", None, choices=SUMMARIES)
    r.str("context", None, choices=("auto", "current_turn", "all_turns"))
    r.str("mode", None)
    effort_kwargs(kwargs, effort)
    return {"effort": effort, "summary": summary}


def _text_format(body: Body, rid: str, harmony: bool) -> tuple[dict, str | None, str | None, str | None]:
    """(the `text` to echo, a note for the instructions, a warning, the grammar to enforce).

    JSON formats are enforced by constrained decoding (freetoken/grammar.py) and the schema also
    goes into the instructions. Without the `grammar` extra they are accepted but not enforced:
    the response header `x-freetoken-warning` and the log say so (clients such as
    `codex exec --output-schema` keep working).
    """
    from freetoken import grammar as g
    text = body.obj("text", None) or Body({}, "text")
    text.only({"format", "verbosity"})
    verbosity = text.str("verbosity", None, choices=("low", "medium", "high"))
    fmt = text.obj("format", None) or Body({"type": "text"}, "text.format")
    kind = fmt.str("type", choices=("text", "json_object", "json_schema"))
    if kind == "text":
        return {"format": {"type": "text"}, "verbosity": verbosity}, None, None, None
    echo = {"type": kind}
    note = "Answer with a single JSON object and nothing else."
    if kind == "json_schema":
        fmt.only({"type", "name", "schema", "description", "strict"})
        echo.update(name=fmt.str("name", nonempty=True, max_len=64), schema=fmt.obj("schema").data,
                    description=fmt.str("description", None), strict=fmt.bool("strict", None))
        note = (f"Answer with a single JSON value that matches the JSON schema {echo['name']!r}, and nothing "
                f"else:\n{json.dumps(echo['schema'], ensure_ascii=False)}")
    text = {"format": echo, "verbosity": verbosity}
    if g.available():
        return text, note, None, json_format_grammar(kind, echo.get("schema"), harmony)
    warning = (f"text.format {kind} is not enforced (constrained decoding is not installed: {g.INSTALL_HINT}); "
               "it was added to the instructions")
    logger.warning("%s: %s", rid, warning)
    return text, note, warning, None


def _history(body: Body, store: ResponseStore) -> list[dict]:
    """The stored conversation of previous_response_id, then this request's input."""
    previous: list[dict] = []
    prev_id = body.str("previous_response_id", None)
    if prev_id is not None:
        previous = store.get(prev_id)
        if previous is None:
            raise APIError(400, f"previous response {prev_id!r} was not found: it was made with store: false, or "
                                f"this server restarted or forgot it (it keeps the last {store.capacity})",
                           param="previous_response_id", code="previous_response_not_found")
    messages = previous + input_messages(body)
    check_tool_results(messages, "call_id")
    return messages


class _Run:
    """One response: its output items as generation events arrive, the final object, its storing."""

    def __init__(self, plan: _Plan, gen: Generation, store: ResponseStore, tokenizer):
        self.plan, self.gen, self.store, self.tokenizer = plan, gen, store, tokenizer
        self.out = Output(TokenText(tokenizer) if plan.params.logprobs is not None else None)

    def response(self, status: str, output: list, **fields) -> dict:
        return {**self.plan.head, "status": status, "error": None, "incomplete_details": None, "usage": None,
                "completed_at": int(time.time()) if status == "completed" else None, "output": output, **fields}

    def finish(self, done: Done) -> tuple[list, dict]:
        """The closing stream events and the final response; a stored one is remembered."""
        events = self.out.finish(done.finish_reason)
        reasoning = self.out.reasoning_text()
        counted = usage(done.usage, len(self.tokenizer.encode(reasoning)) if reasoning else 0)
        if done.finish_reason == "length":
            final = self.response("incomplete", self.out.items, usage=counted,
                                  incomplete_details={"reason": "max_output_tokens"})
        else:
            final = self.response("completed", self.out.items, usage=counted)
        if self.plan.store:
            self.store.put(self.plan.rid, self.plan.history + items_messages(self.out.items, "output"))
        return events, final

    def failed(self, e: GenerationError) -> dict:
        self.out.close("incomplete")
        error = {"code": "invalid_prompt" if e.invalid else "server_error", "message": str(e)}
        return self.response("failed", self.out.items, error=error)

    async def collect(self) -> dict:
        try:
            async for ev in self.gen.events():
                if isinstance(ev, Done):
                    return self.finish(ev)[1]
                self.out.feed(ev)
        except GenerationError as e:
            raise APIError(400 if e.invalid else 500, str(e)) from None
        raise APIError(500, "the generation ended without finishing")

    async def frames(self):
        seq = itertools.count()

        def frame(kind: str, payload: dict) -> str:
            return sse.event(kind, {"type": kind, "sequence_number": next(seq), **payload})
        yield frame("response.created", {"response": self.response("in_progress", [])})
        yield frame("response.in_progress", {"response": self.response("in_progress", [])})
        try:
            async for ev in self.gen.events():
                if isinstance(ev, Ping):
                    yield sse.OPENAI_PING
                    continue
                events, final = self.finish(ev) if isinstance(ev, Done) else (self.out.feed(ev), None)
                for kind, payload in events:
                    yield frame(kind, payload)
                if final is not None:
                    yield frame(f"response.{final['status']}", {"response": final})
        except GenerationError as e:
            yield frame("response.failed", {"response": self.failed(e)})
