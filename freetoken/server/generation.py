"""One request's run through the engine as neutral events, shared by the OpenAI and Anthropic routes.

Prompt text -> token ids happens off the event loop; outputs pass through the reasoning splitter
and the tool-call parser; the end writes one log line and updates the metrics.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import anyio

from freetoken.engine.request import SamplingParams
from freetoken.log import logger
from freetoken.server import access, budget
from freetoken.server.errors import APIError
from freetoken.server.messages import Conversation
from freetoken.server.system_messages import place_system
from freetoken.server.reasoning import OPEN as THINK_OPEN
from freetoken.server.reasoning import CLOSE as THINK_CLOSE
from freetoken.server.harmony import HarmonyParser, template_messages
from freetoken.server.reasoning import ReasoningSplitter
from freetoken.server.toolcalls import ParsedCall, ToolCallParser
from freetoken.tokenizer import TooManyTokens


@dataclass
class GenSpec:
    prompt_ids: list[int]
    params: SamplingParams
    tools: list[dict] | None = None   # parse tool calls against these schemas (None: no parsing)
    reasoning: bool = False           # split <think> blocks out of the content
    think_open: bool = False          # the prompt itself opened <think>
    harmony: bool = False             # gpt-oss's channels (server/harmony.py) instead of <think> / <tool_call>


@dataclass
class Text:
    text: str


@dataclass
class Reasoning:
    text: str


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str                    # JSON object text


@dataclass
class Ping:
    pass


@dataclass
class Logprobs:
    entries: tuple                    # engine TokenLogprob per generated token, in order


@dataclass
class PromptLogprobs:
    entries: tuple                    # None, then a TokenLogprob per further prompt token


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Done:
    finish_reason: str                # stop | length | tool_calls | abort
    usage: Usage
    stop_sequence: str | None = None


class GenerationError(Exception):
    def __init__(self, message: str, invalid: bool):
        super().__init__(message)
        self.invalid = invalid


@dataclass
class Collected:
    """A whole (non-streamed) answer."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    done: Done | None = None
    logprobs: list = field(default_factory=list)      # TokenLogprob per generated token, when asked
    prompt_logprobs: tuple | None = None


def check_prompt(state, ids: list[int], params: SamplingParams, max_tokens_given: bool = False) -> SamplingParams:
    """`params` with an output budget that fits after `ids`, or APIError(400) for a prompt that
    leaves no room to generate (or a given max_tokens beyond it, if the server refuses those:
    server/budget.py)."""
    return budget.fit(state.ready_engine(), len(ids), params, max_tokens_given,
                      refuse=state.config.max_tokens_beyond_room == "refuse")


async def chat_spec(state, conv: Conversation, params: SamplingParams, kwargs: dict, *,
                    max_tokens_given: bool = False, check: bool = True) -> GenSpec:
    """Render the chat template and tokenize, in a worker thread (long prompts take a while);
    then fit the output budget (`check=False` only counts: count_tokens answers any length)."""
    engine = state.ready_engine()
    tokenizer = engine.tokenizer
    tools = conv.template_tools
    limit = budget.TokenLimit.of(engine)

    def render() -> tuple[str, list[int]]:
        messages = place_system(tokenizer, conv.messages)
        if tokenizer.speaks_harmony:
            messages = template_messages(messages)
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
        return text, tokenizer.encode(text, limit=limit.tokens - 1 if check else None)
    try:
        text, ids = await anyio.to_thread.run_sync(render)
    except TooManyTokens as e:            # no room to generate: the 400 with the count, no id list built
        budget.check_prompt(limit, e.tokens)
        raise
    except ValueError as e:               # ChatTemplateError: the template refused these messages
        raise APIError(400, str(e)) from None
    if check:
        params = check_prompt(state, ids, params, max_tokens_given)
    parse_tools = state.parse_tools() and conv.tools is not None and conv.choice != "none"
    tools = conv.tools if parse_tools else None
    if tokenizer.speaks_harmony:          # its markers are special tokens: kept in the text to parse
        return GenSpec(ids, replace(params, skip_special_tokens=False), tools, state.parse_reasoning(), harmony=True)
    think_open = opens_think(text)
    params = _thought_first(params, tokenizer, think_open, state.parse_reasoning() and not closes_think(text))
    return GenSpec(ids, params, tools, state.parse_reasoning(), think_open)


def _thought_first(params: SamplingParams, tokenizer, think_open: bool, may_think: bool) -> SamplingParams:
    """A grammar behind the thought: the one the prompt opened, or (``may_think``: the reasoning
    parser on, no thought closed in the prompt) one the model may open itself; the thought's free
    text then reaches the client as reasoning."""
    if params.grammar is None or tokenizer.token_to_id(THINK_CLOSE) is None:
        return params
    from freetoken.grammar import after_open_thought, optional_thought
    if think_open:
        return replace(params, grammar=after_open_thought(params.grammar, THINK_CLOSE))
    if may_think and tokenizer.token_to_id(THINK_OPEN) is not None:
        return replace(params, grammar=optional_thought(params.grammar, THINK_OPEN, THINK_CLOSE))
    return params


def closes_think(prompt: str) -> bool:
    """Whether the generation prompt already holds a closed thought (thinking switched off)."""
    return THINK_CLOSE in prompt[-64:]


def opens_think(prompt: str) -> bool:
    """Whether the generation prompt (the prompt's tail) leaves a <think> block open."""
    tail = prompt[-64:]
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


class Generation:
    """Submit one request and iterate its events; leaving early aborts it and frees its slots."""

    def __init__(self, state, spec: GenSpec, route: str, rid: str, after: asyncio.Event | None = None):
        self.state, self.spec, self.route, self.rid = state, spec, route, rid
        self.after = after                # submit only once this is set (n > 1: the prompt is cached)
        self.started = asyncio.Event()    # set at the first output (the prompt's prefill is done) or the end
        self.t_start = time.perf_counter()
        self.ttft: float | None = None
        self.cached_tokens = 0            # prompt tokens the prefix cache served, known from the first output
        self.harmony = HarmonyParser() if spec.harmony else None
        self.splitter = ReasoningSplitter(spec.think_open) if spec.reasoning and not spec.harmony else None
        self.tools = ToolCallParser(spec.tools) if spec.tools is not None and not spec.harmony else None
        self.num_calls = 0

    async def events(self):
        """Text / Reasoning / ToolCall / Logprobs events, Ping after `sse_ping_interval` of silence,
        then Done."""
        if self.after is not None:
            await self.after.wait()
        stream = self.state.ready_engine().submit(self.spec.prompt_ids, self.spec.params, self.rid)
        interval = self.state.config.sse_ping_interval or None
        self.state.metrics.active += 1
        last = None
        try:
            while True:
                out = await stream.next(interval)
                if out is None:
                    yield Ping()
                    continue
                last = out
                self.started.set()
                self.cached_tokens = out.cached_tokens
                if out.error is not None:
                    raise GenerationError(out.error, out.invalid)
                if out.finish_reason == "abort":        # only shutdown aborts a request we still read
                    raise GenerationError("the request was aborted: the server is shutting down", False)
                if self.ttft is None and out.token_ids:
                    self.ttft = time.perf_counter() - self.t_start
                if out.prompt_logprobs is not None:
                    yield PromptLogprobs(out.prompt_logprobs)
                if out.logprobs:                  # before the text those tokens make
                    yield Logprobs(out.logprobs)
                for event in self._parse(out.text, final=out.finished):
                    yield event
                if out.finished:
                    yield self._done(out)
                    return
        finally:
            self.started.set()
            stream.abort()      # no-op once finished; otherwise frees the request's KV slots
            self.state.metrics.active -= 1
            self._log(last)

    async def collect(self) -> Collected:
        result = Collected()
        async for event in self.events():
            if isinstance(event, Text):
                result.text += event.text
            elif isinstance(event, Reasoning):
                result.reasoning += event.text
            elif isinstance(event, ToolCall):
                result.calls.append(event)
            elif isinstance(event, Logprobs):
                result.logprobs.extend(event.entries)
            elif isinstance(event, PromptLogprobs):
                result.prompt_logprobs = event.entries
            elif isinstance(event, Done):
                result.done = event
        return result

    def _parse(self, text: str, final: bool):
        if self.harmony is not None:
            yield from self._harmony(text, final)
            return
        parts = self.splitter.feed(text) if self.splitter else [("content", text)]
        if final and self.splitter:
            parts += self.splitter.finish()
        for kind, piece in parts:
            if kind == "reasoning":
                yield Reasoning(piece)
            else:
                yield from self._content(self.tools.feed(piece) if self.tools else [piece])
        if final and self.tools:
            yield from self._content(self.tools.finish())

    def _harmony(self, text: str, final: bool):
        """analysis -> Reasoning (content when the reasoning parser is off), calls -> ToolCall when
        the request gave tools (else dropped, logged), the rest -> Text."""
        for kind, value in self.harmony.feed(text) + (self.harmony.finish() if final else []):
            if kind == "call" and self.spec.tools is None:
                logger.warning("%s: a harmony tool call %r was dropped (the request gave no tools, or "
                               "--tool-call-parser none)", self.rid, value.name)
            elif kind == "call" or kind == "content":
                yield from self._content([value])
            else:
                yield Reasoning(value) if self.spec.reasoning else Text(value)

    def _content(self, items):
        for item in items:
            if isinstance(item, ParsedCall):
                yield ToolCall(self.num_calls, item.name, item.arguments)
                self.num_calls += 1
            elif item:
                yield Text(item)

    def _done(self, out) -> Done:
        reason = out.finish_reason
        if self.num_calls and reason == "stop":
            reason = "tool_calls"
        return Done(reason, Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens),
                    out.stop_sequence)

    def _log(self, out) -> None:
        seconds = time.perf_counter() - self.t_start
        finish = "disconnected" if out is None or not out.finished else out.finish_reason
        if finish == "stop" and self.num_calls:
            finish = "tool_calls"
        prompt = len(self.spec.prompt_ids)
        completion = out.completion_tokens if out else 0
        cached = out.cached_tokens if out else 0
        decode_s = seconds - (self.ttft or seconds)
        rate = (completion - 1) / decode_s if completion > 1 and decode_s > 0 else 0.0
        self.state.metrics.observe_generation(self.route, finish, prompt, completion, cached, self.ttft, seconds)
        access.note_generation(prompt, completion, cached, self.ttft, seconds)
        ttft = f"{self.ttft:.3f}s" if self.ttft is not None else "-"
        logger.info("%s %s | prompt %d (cached %d) | output %d | ttft %s | %.1f tok/s | %.2fs | %s",
                    self.rid, self.route, prompt, cached, completion, ttft, rate, seconds, finish)


async def cancel_on_disconnect(request, coro):
    """Await `coro` unless the client goes away first (then cancel it and return None)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()
