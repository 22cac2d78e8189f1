"""Turns a schedule (requests, new-token counts) into a ForwardBatch, runs the model, samples.

Shape legend: T new tokens in the step, B sequences, R logits rows (B, plus every prompt position
of a request that asked for prompt logprobs), C longest context in the batch, V vocab.
"""
from __future__ import annotations

import numpy as np

from freetoken.engine.sampler import sample, token_logprobs
from freetoken.models.forward_batch import ForwardBatch
from freetoken.models.state_cuts import split as state_cuts_split


def wants_prompt_rows(req) -> bool:
    return req.params.prompt_logprobs is not None and req.in_prefill


def build_batch(schedule, alloc, state_cuts=None) -> ForwardBatch:
    """Allocate KV slots for the new tokens and lay out the flat index arrays. state_cuts(req, n):
    (offset, sink) of each recurrent state the step should capture (hybrid prefill)."""
    ids, positions, tok_seq, slots, last, cuts = [], [], [], [], [], []
    for b, (req, n) in enumerate(schedule):
        start = req.num_computed
        if state_cuts is not None:
            cuts.extend((len(ids) + offset, b, sink) for offset, sink in state_cuts(req, n))
        req.slots.extend(alloc(n))
        ids.extend(req.ids_at(start, n))
        positions.extend(range(start, start + n))
        tok_seq.extend([b] * n)
        slots.extend(req.slots[start:start + n])
        last.extend(range(len(ids) - n, len(ids)) if wants_prompt_rows(req) else [len(ids) - 1])
    context = max(req.num_computed + n for req, n in schedule)
    table = np.zeros((len(schedule), context), dtype=np.int32)          # [B, C]
    for b, (req, n) in enumerate(schedule):
        table[b, :req.num_computed + n] = slot_row(req, req.num_computed + n)
    as32 = lambda a: np.asarray(a, dtype=np.int32)
    hybrid = schedule[0][0].state_row is not None
    seq_starts = as32(np.cumsum([0] + [n for _, n in schedule])) if hybrid else None
    state_slots = as32([req.state_row for req, _ in schedule]) if hybrid else None
    return ForwardBatch(ids=as32(ids), positions=as32(positions), tok_seq=as32(tok_seq),
                        slots=as32(slots), slot_table=table, last_index=as32(last),
                        prefill=any(n > 1 for _, n in schedule), seq_starts=seq_starts, state_slots=state_slots,
                        state_cuts=state_cuts_split(seq_starts, state_slots, cuts) if cuts else ())


def slot_row(req, n: int) -> np.ndarray:
    """req.slots[:n] as int32, kept on the request and extended by the slots new since its last
    step: converting the whole list each step cost ~0.3 ms at 16k tokens of context."""
    row, done = req.slot_row, req.slot_row_len if req.slot_row_of is req.slots else 0
    done = min(done, n)
    if row is None or row.shape[0] < n:
        grown = np.empty(max(n, 2 * (0 if row is None else row.shape[0]), 64), np.int32)
        if done:
            grown[:done] = row[:done]
        row = grown
    row[done:n] = req.slots[done:n]
    req.slot_row, req.slot_row_len, req.slot_row_of = row, n, req.slots
    return row[:n]


def run_step(forward, ops, schedule, alloc, state_cuts=None):
    """Forward the scheduled tokens; returns (requests that sampled, their new token ids, their
    TokenLogprob or None each). Prompt logprobs are appended to their requests on the way.
    forward: host ForwardBatch -> logits [R, V] (the model, or CUDA-graph replay)."""
    rows = [n if wants_prompt_rows(req) else 1 for req, n in schedule]
    logits = forward(build_batch(schedule, alloc, state_cuts))            # [R, V]
    ends = np.cumsum(rows) - 1                                            # each sequence's last row
    done_prompt = []
    for b, (req, n) in enumerate(schedule):
        if wants_prompt_rows(req):
            _prompt_logprobs(ops, req, logits[int(ends[b]) - n + 1:int(ends[b]) + 1])
        req.num_computed += n
        if req.num_computed == req.num_tokens:    # reached the end of what is known: sample
            done_prompt.append(b)
    if not done_prompt:
        return [], np.empty(0, np.int64), []
    reqs = [schedule[b][0] for b in done_prompt]
    picked = logits if len(done_prompt) == logits.shape[0] else logits[ops.xp.asarray(ends[done_prompt])]
    tokens, lps = sample(ops, picked, reqs)
    return reqs, tokens, lps


def _prompt_logprobs(ops, req, logits) -> None:
    """Append the TokenLogprob of each prompt token these rows predict (logits [n, V] of the
    positions computed now; position p predicts token p + 1). The first prompt token has none."""
    start, P = req.num_computed, len(req.prompt_ids)
    if start == 0:
        req.prompt_logprobs.append(None)
    n = min(logits.shape[0], P - 1 - start)          # the last prompt position predicts the output
    if n > 0:
        req.prompt_logprobs.extend(token_logprobs(ops, logits[:n], req.prompt_ids[start + 1:start + 1 + n],
                                                  req.params.prompt_logprobs))
