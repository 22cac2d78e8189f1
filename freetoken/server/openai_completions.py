"""POST /v1/completions (the legacy text API): prompt text or ids, `echo`, legacy `logprobs`
(with the prompt's when echoing: what lm-evaluation-harness scores loglikelihood tasks with),
`n` choices, and `max_tokens: 0` with `echo` to score a prompt without generating."""
from __future__ import annotations

import time
from dataclasses import replace

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.server import openai_fields as fields
from freetoken.server import sse
from freetoken.server.body import read_json
from freetoken.server.choices import fan_out, merged, total_usage
from freetoken.server.errors import APIError
from freetoken.server.generation import (Done, GenerationError, GenSpec, Logprobs, Ping, PromptLogprobs, Text,
                                         Usage, check_prompt)
from freetoken.server.logprobs import TokenText, completion_logprobs
from freetoken.server.openai_api import (COMMON_FIELDS, _common, _stream_flags, collect, error_frame, usage)
from freetoken.server.protocol import Body, sampling, stop_strings
from freetoken.server.state import new_id

COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
LEGACY_MAX_TOKENS = 16       # /v1/completions' documented default


async def completions(request: Request) -> Response:
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    body.only(COMPLETION_FIELDS)
    _common(body, state)
    body.default_only("suffix", ("",))
    body.default_only("best_of", (1,), "other than 1 is not supported")
    echo, k = body.bool("echo", False), fields.completion_logprobs(body)
    max_tokens = body.int("max_tokens", None, lo=0)
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens 0 generates nothing: it needs echo (to score the prompt)", param="max_tokens")
    score_only = max_tokens == 0       # one token is generated and dropped: the engine always samples one
    params = sampling(body, state.limits(LEGACY_MAX_TOKENS), max_tokens=1 if score_only else max_tokens,
                      stop=stop_strings(body, "stop"), temperature_max=2.0)
    engine = state.ready_engine()
    params = replace(fields.with_penalties(body, params, engine.tokenizer.vocab_size), logprobs=k,
                     prompt_logprobs=k if echo else None)
    stream, include_usage = _stream_flags(body)
    ids, prompt_text = await _prompt(body, engine.tokenizer)
    params = check_prompt(engine, ids, params, max_tokens_given=body.has("max_tokens"))
    gens = fan_out(state, GenSpec(ids, params), "/v1/completions", new_id("cmpl-"), fields.choices(body))
    view = _View(TokenText(engine.tokenizer), ids, prompt_text if echo else None, k is not None, score_only)
    head = {"id": gens[0].rid, "object": "text_completion", "created": int(time.time()), "model": body.data["model"]}
    if stream:
        return sse.response(_frames(gens, head, include_usage, view))
    results = await collect(request, gens)
    if results is None:
        return Response(status_code=499)
    prompt_lps = results[0].prompt_logprobs
    choices = [view.choice(i, r, prompt_lps) for i, r in enumerate(results)]
    return JSONResponse({**head, "choices": choices,
                         "usage": usage(view.usage(total_usage([r.done.usage for r in results])))})


class _View:
    """How this request's choices read: echoed prompt, legacy logprobs, scored-only prompts."""

    def __init__(self, text: TokenText, ids, echo: str | None, logprobs: bool, score_only: bool):
        self.text, self.ids, self.echo, self.logprobs, self.score_only = text, ids, echo, logprobs, score_only

    def choice(self, index: int, result, prompt_lps) -> dict:
        body = self.logprobs_of([] if self.score_only else result.logprobs, prompt_lps, 0)
        finish = "length" if self.score_only else result.done.finish_reason
        return {"index": index, "text": (self.echo or "") + ("" if self.score_only else result.text),
                "logprobs": body, "finish_reason": finish}

    def logprobs_of(self, lps, prompt_lps, offset: int) -> dict | None:
        """The legacy logprobs object of these tokens (the prompt's first when echoing and
        `prompt_lps` is given), or None when the request asked for none."""
        if not self.logprobs:
            return None
        echo = (self.ids, prompt_lps) if self.echo is not None and prompt_lps is not None else None
        return completion_logprobs(self.text, lps, echo, offset)

    def usage(self, u: Usage) -> Usage:
        return replace(u, completion_tokens=0) if self.score_only else u


async def _prompt(body: Body, tokenizer) -> tuple[list[int], str]:
    """(token ids, prompt text) of a string, a one-item list of strings, or token ids (flat or a
    one-item list of lists; their text is the decoded ids)."""
    prompt = body.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await anyio.to_thread.run_sync(tokenizer.encode, prompt), prompt
    vocab = tokenizer.vocab_size
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocab for t in prompt):
        return list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    raise APIError(400, f"prompt must be a string or a non-empty list of token ids in [0, {vocab}) "
                        "(one prompt per request)", param="prompt")


async def _frames(gens, head: dict, include_usage: bool, view: _View):
    extra = {"usage": None} if include_usage else {}
    offsets, echoed, usages, prompt_lps = [0] * len(gens), [False] * len(gens), [], None

    def chunk(i: int, text: str, logprobs=None, finish=None) -> str:
        return sse.data({**head, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish}], **extra})
    try:
        async for i, ev in merged(gens):
            if isinstance(ev, Ping):
                yield sse.OPENAI_PING
                continue
            if isinstance(ev, PromptLogprobs):     # the first choice's, first: every choice echoes them
                prompt_lps = ev.entries
            if view.echo is not None and not echoed[i]:
                echoed[i] = True
                lp = view.logprobs_of([], prompt_lps, 0)
                offsets[i] = _end(lp, len(view.echo))
                yield chunk(i, view.echo, lp)
            if isinstance(ev, Text) and not view.score_only:
                yield chunk(i, ev.text)
            elif isinstance(ev, Logprobs) and view.logprobs and not view.score_only:
                lp = view.logprobs_of(ev.entries, None, offsets[i])
                offsets[i] = _end(lp, offsets[i])
                yield chunk(i, "", lp)
            elif isinstance(ev, Done):
                usages.append(ev.usage)
                yield chunk(i, "", finish="length" if view.score_only else ev.finish_reason)
    except GenerationError as e:
        yield error_frame(e)
        return
    if include_usage:
        yield sse.data({**head, "choices": [], "usage": usage(view.usage(total_usage(usages)))})
    yield "data: [DONE]\n\n"


def _end(lp: dict | None, default: int) -> int:
    """The text offset after a logprobs chunk's last token."""
    if not lp or not lp["tokens"]:
        return default
    return lp["text_offset"][-1] + len(lp["tokens"][-1])
