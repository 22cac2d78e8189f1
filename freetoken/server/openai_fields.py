"""The OpenAI sampling fields beyond the shared ones: penalties, logit_bias, logprobs and n.

Each is read and range-checked here (a 400 naming the field) and lands in SamplingParams; the
engine applies them with the penalties and logprobs ops (docs/api.md says what each does).
"""
from __future__ import annotations

from dataclasses import replace

from freetoken.engine.request import MAX_TOP_LOGPROBS, InvalidRequest, SamplingParams
from freetoken.server.errors import APIError
from freetoken.server.protocol import Body

MAX_CHOICES = 16            # n: more would queue behind --max-running-requests anyway


# vLLM's request priority: gateways (SMG) forward it as 0 on every request; no other value means
# anything here, where requests are admitted in arrival order
PRIORITY_REFUSED = "other than 0 is not supported: requests are admitted in arrival order"


def with_penalties(body: Body, params: SamplingParams, vocab: int) -> SamplingParams:
    """presence/frequency_penalty in [-2, 2], repetition_penalty in (0, 10], logit_bias."""
    return _replace(params, presence_penalty=body.float("presence_penalty", 0.0, lo=-2.0, hi=2.0),
                    frequency_penalty=body.float("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
                    repetition_penalty=body.float("repetition_penalty", 1.0, lo=0.0, hi=10.0, lo_open=True),
                    logit_bias=_logit_bias(body, vocab))


def _logit_bias(body: Body, vocab: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...); ids are checked against the vocabulary."""
    if not body.has("logit_bias"):
        return ()
    bias = body.obj("logit_bias")
    pairs = []
    for key in bias.data:
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}",
                           param="logit_bias")
        pairs.append((int(key), bias.float(key, lo=-100.0, hi=100.0)))
    return tuple(pairs)


def chat_logprobs(body: Body) -> int | None:
    """`logprobs: true` (+ `top_logprobs` 0..20) -> how many top logprobs; None when off."""
    on = body.bool("logprobs", False)
    top = body.int("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not on:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if on else None


def completion_logprobs(body: Body) -> int | None:
    """Legacy `logprobs: K` (0..20; OpenAI's own limit is 5) -> K; None when absent."""
    return body.int("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)


def choices(body: Body) -> int:
    return body.int("n", 1, lo=1, hi=MAX_CHOICES)


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    try:
        return replace(params, **changes)
    except InvalidRequest as e:
        raise APIError(400, str(e)) from None
