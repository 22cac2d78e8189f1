"""Does a request fit: its prompt and its output budget against the context and the KV pool.

A request holds prompt + max_tokens KV slots for its whole life, so its limit is the context
length or the KV pool, whichever is smaller. What does not fit is refused with the counts, in
the sentence each API's real service uses (clients parse them: Claude Code compacts on "prompt is
too long", and lowers max_tokens on "input length and `max_tokens` exceed context limit"):

- a prompt that leaves no room for one output token: 400 ``context_length_exceeded``;
- a ``max_tokens`` the client gave that does not fit what is left: shortened to what is left, with
  an INFO line (``--max-tokens-beyond-room shorten``, the default, as llama.cpp's server does), or
  refused with a 400 giving the counts (``refuse``, as vLLM and the hosted APIs do). Shortening is
  the default because clients do not recover from the 400 on a small context: Claude Code asks
  32000 and, on the Anthropic sentence below, retries only when the context leaves 1000 + 3000
  tokens past the prompt (2.1.197; docs/api.md has the evidence), and the SDKs raise;
- a budget the server chose (``--default-max-tokens``, or "up to the context" when that is 0)
  is shortened to what is left: the client asked for nothing, so nothing is broken.
An output budget that runs out ends the answer with finish reason ``length`` / ``max_tokens``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from freetoken.engine.request import SamplingParams
from freetoken.server.errors import APIError


@dataclass(frozen=True)
class TokenLimit:
    tokens: int                 # most prompt + output tokens one request can hold
    context: int                # the context length (--max-model-len)
    kv: int                     # the KV pool (--num-kv-tokens)

    @classmethod
    def of(cls, engine) -> "TokenLimit":
        context, kv = engine.max_model_len, engine.kv_tokens
        return cls(min(context, kv), context, kv)

    def what(self) -> str:
        """The OpenAI-side sentence naming the limit (the pool when it is the smaller one)."""
        if self.kv < self.context:
            return (f"This server's KV pool holds {self.kv} tokens (--num-kv-tokens), less than the "
                    f"model's context length of {self.context} tokens")
        return f"This model's maximum context length is {self.context} tokens"


log = logging.getLogger("freetoken")


def fit(engine, prompt_tokens: int, params: SamplingParams, max_tokens_given: bool,
        refuse: bool = False) -> SamplingParams:
    """`params` with an output budget that fits, or APIError(400) with the counts (a prompt with no
    room; a given max_tokens beyond the room when ``refuse``)."""
    if prompt_tokens == 0:
        raise APIError(400, "the prompt is empty")
    limit = TokenLimit.of(engine)
    check_prompt(limit, prompt_tokens)
    room = limit.tokens - prompt_tokens
    if params.max_tokens <= room:
        return params
    if max_tokens_given and refuse:
        raise _max_tokens_error(limit, prompt_tokens, params.max_tokens)
    if max_tokens_given:
        log.info("max_tokens %d shortened to %d: the %d-token prompt leaves that much of %d "
                 "(--max-tokens-beyond-room refuse answers 400 instead)", params.max_tokens, room,
                 prompt_tokens, limit.tokens)
    return replace(params, max_tokens=room)


def check_prompt(limit: TokenLimit, n: int) -> None:
    """At least one output token must fit after the prompt."""
    if n < limit.tokens:
        return
    message = (f"{limit.what()}. However, your request has {n} input tokens, and at least one token "
               f"must be left for the output. Please reduce the length of the input.")
    raise APIError(400, message, code="context_length_exceeded",
                   extra={"prompt_tokens": n, "context_length": limit.tokens},
                   wording={"anthropic": f"prompt is too long: {n} tokens > {limit.tokens - 1} maximum"})


def _max_tokens_error(limit: TokenLimit, n: int, max_tokens: int) -> APIError:
    message = (f"'max_tokens' is too large: {max_tokens}. {limit.what()} and your request has {n} input "
               f"tokens ({max_tokens} > {limit.tokens} - {n}). Lower max_tokens or shorten the input.")
    anthropic = (f"input length and `max_tokens` exceed context limit: {n} + {max_tokens} > {limit.tokens}, "
                 f"decrease input length or `max_tokens` and try again")
    return APIError(400, message, param="max_tokens", code="context_length_exceeded",
                    extra={"prompt_tokens": n, "max_tokens": max_tokens, "context_length": limit.tokens},
                    wording={"anthropic": anthropic})
