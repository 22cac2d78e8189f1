"""A step's logits to tokens: penalties and logit_bias, grammar masks, sampling, logprobs.

Shape legend: B sequences that sample, V vocab, N adjusted (row, token) entries, K top logprobs.
Everything that touches logits is an op (penalties, sampling, logprobs); this module only builds
their inputs from the requests, so the same code serves every backend.
"""
from __future__ import annotations

import numpy as np

from freetoken.engine.request import TokenLogprob

_EMPTY = np.empty(0, np.int64)


def sample(ops, logits, requests) -> tuple[np.ndarray, list]:
    """One token per row of logits [B, V] (uniforms from each request's own seeded stream), and
    each request's TokenLogprob (None where it asked for none). Logprobs are of the raw logits."""
    p = [r.params for r in requests]
    f32 = lambda v: np.asarray(v, dtype=np.float32)
    uniforms = f32([r.rng.random() for r in requests])
    adjusted = _penalized(ops, logits, requests)
    tokens = ops.sampling(
        adjusted, f32([x.temperature for x in p]), np.asarray([max(x.top_k, 0) for x in p], np.int32),
        f32([x.top_p for x in p]), f32([x.min_p for x in p]), uniforms, **_mask(logits, requests))
    tokens = np.asarray(ops.to_host(tokens), dtype=np.int64)
    wanted = [b for b, x in enumerate(p) if x.logprobs is not None]
    lps = [None] * len(requests)
    if wanted:
        k = max(p[b].logprobs for b in wanted)
        rows = logits if len(wanted) == len(requests) else logits[ops.xp.asarray(wanted)]
        for b, lp in zip(wanted, token_logprobs(ops, rows, tokens[wanted], k)):
            lps[b] = _trim(lp, p[b].logprobs)
    return tokens, lps


def token_logprobs(ops, logits, chosen, k: int) -> list[TokenLogprob]:
    """TokenLogprob of chosen[r] under each row r of logits [R, V], with the top k."""
    lp, ids, top = (ops.to_host(a) for a in ops.logprobs(logits, np.asarray(chosen, np.int32), k))
    return [TokenLogprob(int(c), float(lp[r]), tuple(zip(ids[r].tolist(), top[r].tolist())))
            for r, c in enumerate(chosen)]


def _trim(lp: TokenLogprob, k: int) -> TokenLogprob:
    return lp if len(lp.top) == k else TokenLogprob(lp.token, lp.logprob, lp.top[:k])


def _mask(logits, requests) -> dict:
    """{"mask": int32[B, ceil(V/32)]} when a request is constrained (its matcher writes its row,
    the others stay all -1), else {} so the op runs exactly as without grammars."""
    if all(r.matcher is None for r in requests):
        return {}
    mask = np.full((len(requests), (logits.shape[1] + 31) // 32), -1, np.int32)
    for b, r in enumerate(requests):
        if r.matcher is not None:
            r.matcher.fill(mask[b])
    return {"mask": mask}


def _penalized(ops, logits, requests):
    """The logits the sampler sees: a penalized copy when a request adjusts its logits, else the
    model's own array (no copy, no launch)."""
    if not any(r.params.adjusts_logits for r in requests):
        return logits
    parts = [(b, *penalty_entries(r)) for b, r in enumerate(requests) if r.params.adjusts_logits]
    cat = lambda i, dt: np.concatenate([e[i] for e in parts]).astype(dt)
    rows = np.concatenate([np.full(len(e[1]), e[0], np.int32) for e in parts])
    p = [r.params for r in requests]
    f32 = lambda v: np.asarray(v, dtype=np.float32)
    return ops.penalties(logits, rows, cat(1, np.int32), cat(2, np.int32), cat(3, np.int32),
                         cat(4, np.float32), f32([x.presence_penalty for x in p]),
                         f32([x.frequency_penalty for x in p]), f32([x.repetition_penalty for x in p]))


def penalty_entries(req) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, output counts, in-prompt flags, bias) of one request, tokens sorted and unique:
    every token the penalties or logit_bias can touch."""
    params = req.params
    out_tokens = np.fromiter(req.output_counts.keys(), np.int64, len(req.output_counts))
    out_counts = np.fromiter(req.output_counts.values(), np.int64, len(req.output_counts))
    prompt = _prompt_tokens(req) if params.repetition_penalty != 1.0 else _EMPTY
    bias_tokens = np.asarray([t for t, _ in params.logit_bias], np.int64)
    tokens = np.union1d(np.union1d(out_tokens, prompt), bias_tokens)
    counts = np.zeros(tokens.shape[0], np.int64)
    counts[np.searchsorted(tokens, out_tokens)] = out_counts
    in_prompt = np.zeros(tokens.shape[0], np.int64)
    in_prompt[np.searchsorted(tokens, prompt)] = 1
    bias = np.zeros(tokens.shape[0], np.float32)
    bias[np.searchsorted(tokens, bias_tokens)] = [b for _, b in params.logit_bias]
    return tokens, counts, in_prompt, bias


def _prompt_tokens(req) -> np.ndarray:
    """The prompt's distinct token ids (sorted), computed once per request."""
    if req.prompt_unique is None:
        req.prompt_unique = np.unique(np.asarray(req.prompt_ids, np.int64))
    return req.prompt_unique
