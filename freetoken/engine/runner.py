"""Turns a schedule (requests, new-token counts) into a ForwardBatch, runs the model, samples.

Shape legend: T new tokens in the step, B sequences, C longest context in the batch, V vocab.
"""
from __future__ import annotations

import numpy as np

from freetoken.models.qwen3_moe import ForwardBatch


def build_batch(schedule, alloc) -> ForwardBatch:
    """Allocate KV slots for the new tokens and lay out the flat index arrays."""
    ids, positions, tok_seq, slots, last = [], [], [], [], []
    for b, (req, n) in enumerate(schedule):
        start = req.num_computed
        req.slots.extend(alloc(n))
        ids.extend(req.all_ids[start:start + n])
        positions.extend(range(start, start + n))
        tok_seq.extend([b] * n)
        slots.extend(req.slots[start:start + n])
        last.append(len(ids) - 1)
    context = max(req.num_computed + n for req, n in schedule)
    table = np.zeros((len(schedule), context), dtype=np.int32)          # [B, C]
    for b, (req, n) in enumerate(schedule):
        table[b, :req.num_computed + n] = req.slots[:req.num_computed + n]
    as32 = lambda a: np.asarray(a, dtype=np.int32)
    return ForwardBatch(ids=as32(ids), positions=as32(positions), tok_seq=as32(tok_seq),
                        slots=as32(slots), slot_table=table, last_index=as32(last),
                        prefill=any(n > 1 for _, n in schedule))


def sample(ops, logits, requests) -> np.ndarray:
    """One token per row of logits [B, V]; uniforms come from each request's own seeded stream."""
    p = [r.params for r in requests]
    f32 = lambda v: np.asarray(v, dtype=np.float32)
    uniforms = f32([r.rng.random() for r in requests])
    tokens = ops.sampling(
        logits, f32([x.temperature for x in p]), np.asarray([max(x.top_k, 0) for x in p], np.int32),
        f32([x.top_p for x in p]), f32([x.min_p for x in p]), uniforms, **_mask(logits, requests))
    return np.asarray(ops.to_host(tokens), dtype=np.int64)


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


def run_step(forward, ops, schedule, alloc):
    """Forward the scheduled tokens; returns (requests that sampled, their new token ids).
    forward: host ForwardBatch -> logits [B, V] (the model, or CUDA-graph replay)."""
    logits = forward(build_batch(schedule, alloc))                        # [B, V]
    done_prompt = []
    for b, (req, n) in enumerate(schedule):
        req.num_computed += n
        if req.num_computed == req.num_tokens:    # reached the end of what is known: sample
            done_prompt.append(b)
    if not done_prompt:
        return [], np.empty(0, np.int64)
    reqs = [schedule[b][0] for b in done_prompt]
    return reqs, sample(ops, logits[ops.xp.asarray(done_prompt)], reqs)
