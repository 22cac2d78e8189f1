"""POST /v1/completions (the legacy text API): prompt text or ids, `echo`, legacy `logprobs`
(with the prompt's when echoing: what lm-evaluation-harness scores loglikelihood tasks with),
`n` choices, a batch of prompts (choice index = prompt index * n + j), and `max_tokens: 0` with
`echo` to score a prompt without generating."""
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
MAX_SEQUENCES = 256          # prompts x n in one request; they queue behind --max-running-requests


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
    prompts, n = await _prompts(body, engine.tokenizer), fields.choices(body)
    if len(prompts) * n > MAX_SEQUENCES:
        raise APIError(400, f"{len(prompts)} prompts x n {n} is more than {MAX_SEQUENCES} sequences in one request",
                       param="prompt")
    rid = new_id("cmpl-")
    gens = []
    for p, (ids, _) in enumerate(prompts):       # choice index = prompt index * n + j, as OpenAI
        spec = GenSpec(ids, check_prompt(state, ids, params, max_tokens_given=body.has("max_tokens")))
        gens += fan_out(state, spec, "/v1/completions", rid if p == 0 else f"{rid}-p{p}", n)
    view = _View(TokenText(engine.tokenizer), prompts, n, echo, k is not None, score_only)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.data["model"]}
    if stream:
        return sse.response(_frames(gens, head, include_usage, view))
    results = await collect(request, gens)
    if results is None:
        return Response(status_code=499)
    choices = [view.choice(i, r, results[i - i % n].prompt_logprobs) for i, r in enumerate(results)]
    return JSONResponse({**head, "choices": choices,
                         "usage": usage(view.usage(batch_usage([r.done.usage for r in results], n)))})


def batch_usage(usages: list[Usage], n: int) -> Usage:
    """Each prompt counted once, every completion summed (OpenAI's usage for a batch): `usages`
    holds n choices per prompt, in choice-index order."""
    per_prompt = [total_usage(usages[i:i + n]) for i in range(0, len(usages), n)]
    return Usage(*(sum(getattr(u, f) for u in per_prompt) for f in ("prompt_tokens", "completion_tokens",
                                                                     "cached_tokens")))


class _View:
    """How this request's choices read: echoed prompt, legacy logprobs, scored-only prompts."""

    def __init__(self, text: TokenText, prompts, n: int, echo: bool, logprobs: bool, score_only: bool):
        self.text, self.prompts, self.n = text, prompts, n
        self.echo, self.logprobs, self.score_only = echo, logprobs, score_only

    def echoed(self, index: int) -> str:
        return self.prompts[index // self.n][1] if self.echo else ""

    def choice(self, index: int, result, prompt_lps) -> dict:
        body = self.logprobs_of(index, [] if self.score_only else result.logprobs, prompt_lps, 0)
        finish = "length" if self.score_only else result.done.finish_reason
        return {"index": index, "text": self.echoed(index) + ("" if self.score_only else result.text),
                "logprobs": body, "finish_reason": finish}

    def logprobs_of(self, index: int, lps, prompt_lps, offset: int) -> dict | None:
        """The legacy logprobs object of choice `index`'s tokens (its prompt's first when
        echoing and `prompt_lps` is given), or None when the request asked for none."""
        if not self.logprobs:
            return None
        ids = self.prompts[index // self.n][0]
        echo = (ids, prompt_lps) if self.echo and prompt_lps is not None else None
        return completion_logprobs(self.text, lps, echo, offset)

    def usage(self, u: Usage) -> Usage:
        return replace(u, completion_tokens=0) if self.score_only else u


async def _prompts(body: Body, tokenizer) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt: a string, token ids, or an array of either (a batch, as
    lm-evaluation-harness sends); the text of ids is their decoding."""
    prompt = body.data.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    if len(batch) > MAX_SEQUENCES:
        raise APIError(400, f"at most {MAX_SEQUENCES} prompts per request", param="prompt")
    out = []
    for i, p in enumerate(batch):
        out.append(await _one_prompt(p, tokenizer, "prompt" if batch[0] is prompt else f"prompt[{i}]"))
    return out


async def _one_prompt(prompt, tokenizer, param: str) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        return await anyio.to_thread.run_sync(tokenizer.encode, prompt), prompt
    vocab = tokenizer.vocab_size
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocab for t in prompt):
        return list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    raise APIError(400, f"{param} must be a string, a non-empty list of token ids in [0, {vocab}), or an array "
                        "of those", param=param)


async def _frames(gens, head: dict, include_usage: bool, view: _View):
    extra = {"usage": None} if include_usage else {}
    offsets, echoed, usages, prompt_lps = [0] * len(gens), [False] * len(gens), [None] * len(gens), {}

    def chunk(i: int, text: str, logprobs=None, finish=None) -> str:
        return sse.data({**head, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish}], **extra})
    try:
        async for i, ev in merged(gens):
            if isinstance(ev, Ping):
                yield sse.OPENAI_PING
                continue
            if isinstance(ev, PromptLogprobs):     # a prompt's first choice has them, before its others start
                prompt_lps[i // view.n] = ev.entries
            if view.echo and not echoed[i]:
                echoed[i] = True
                lp = view.logprobs_of(i, [], prompt_lps.get(i // view.n), 0)
                offsets[i] = _end(lp, len(view.echoed(i)))
                yield chunk(i, view.echoed(i), lp)
            if isinstance(ev, Text) and not view.score_only:
                yield chunk(i, ev.text)
            elif isinstance(ev, Logprobs) and view.logprobs and not view.score_only:
                lp = view.logprobs_of(i, ev.entries, None, offsets[i])
                offsets[i] = _end(lp, offsets[i])
                yield chunk(i, "", lp)
            elif isinstance(ev, Done):
                usages[i] = ev.usage
                yield chunk(i, "", finish="length" if view.score_only else ev.finish_reason)
    except GenerationError as e:
        yield error_frame(e)
        return
    if include_usage:
        yield sse.data({**head, "choices": [], "usage": usage(view.usage(batch_usage(usages, view.n)))})
    yield "data: [DONE]\n\n"


def _end(lp: dict | None, default: int) -> int:
    """The text offset after a logprobs chunk's last token."""
    if not lp or not lp["tokens"]:
        return default
    return lp["text_offset"][-1] + len(lp["tokens"][-1])
