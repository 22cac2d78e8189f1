"""How a hybrid model's requests use the prefix cache: resume from the deepest cached prefix that
has a recurrent-state checkpoint, end prefill chunks at anchor positions so the state there can be
checkpointed, and link those checkpoints to the tree once the prompt's KV is in it (at the end of
prefill) or when the request finishes (the state after everything it computed).

Called by the Scheduler only for hybrid models with a checkpoint pool (engine/build.py).
"""
from __future__ import annotations

from bisect import bisect_right

ANCHORS_PER_PROMPT = 16    # checkpoints one prompt's prefill may take, besides its end


class Resumer:
    def __init__(self, cache, pool, states, anchors):
        self.cache, self.pool, self.states, self.anchors = cache, pool, states, anchors

    def add(self, req) -> None:
        """Where this prompt's state is worth keeping: its last anchors and its end. Harnesses
        edit near the recent end (the previous turn's thinking, the tool output that just left the
        window), and each checkpoint of a real model costs tens of MiB, so older anchors, which
        earlier requests have checkpointed already, are not taken again."""
        req.anchors = self.anchors.positions(req.prompt_ids)[-ANCHORS_PER_PROMPT:] + [len(req.prompt_ids)]

    def reuse(self, req) -> None:
        """Take the deepest resumable cached prefix of all but the last prompt token (locked)."""
        if req.params.prompt_logprobs is not None:    # needs every position's logits
            slots, node = [], self.cache.root
        else:
            slots, node = self.cache.match_resumable(req.prompt_ids[:-1])
        self.cache.lock(node)
        req.lock_node, req.slots = node, list(slots)
        req.num_computed = req.num_cached = len(slots)
        req.resume = node.checkpoint if slots else None

    def start(self, req) -> None:
        """The request got its state row: load the checkpoint it resumes from (else it is zero)."""
        if req.resume is not None:
            self.pool.restore(req.resume, self.states, req.state_row)
            req.resume = None

    def chunk(self, req, n: int) -> int:
        """n, shortened so that the chunk ends at the next anchor (its state is then on hand)."""
        i = bisect_right(req.anchors, req.num_computed)
        return min(n, req.anchors[i] - req.num_computed) if i < len(req.anchors) else n

    def after_step(self, req) -> None:
        """After a forward of req's prefill chunk: checkpoint when it ended at an anchor."""
        i = bisect_right(req.anchors, req.num_computed) - 1
        if i >= 0 and req.anchors[i] == req.num_computed and req.num_computed > req.num_cached:
            ckpt = self.pool.take(self.states, req.state_row, req.num_computed)
            if ckpt is not None:
                req.pending.append(ckpt)

    def link(self, req, tokens) -> None:
        """Link the pending checkpoints whose position is within `tokens` (now in the tree)."""
        keep = []
        for ckpt in req.pending:
            node = self.cache.node_at(tokens[:ckpt.position]) if ckpt.position <= len(tokens) else None
            if node is not None:
                self.pool.link(ckpt, node)
            elif ckpt.position > len(tokens):
                keep.append(ckpt)
            else:
                self.pool.counters.dropped += 1
        req.pending = keep

    def sampled(self, req, token: int) -> None:
        """Decode just sampled `token`: when it opens a tool call (a one-token opener), keep the
        state before it, which the next turn's prompt shares up to that point."""
        taken = req.pending and req.pending[-1].position == req.num_computed   # e.g. at the prompt's end
        if token in self.anchors.openers and req.state_row is not None and req.num_computed > req.num_cached \
                and not taken:
            ckpt = self.pool.take(self.states, req.state_row, req.num_computed)
            if ckpt is not None:
                req.pending.append(ckpt)

    def discard(self, req) -> None:
        """Checkpoints the request took that never got a node (beyond what it computed)."""
        self.pool.counters.dropped += len(req.pending)
        req.pending = []

    def finish(self, req, reason: str) -> None:
        """A completed request leaves the state after everything it computed (the next turn of a
        conversation extends exactly that)."""
        if reason in ("stop", "length") and req.state_row is not None and req.num_computed > 0:
            ckpt = self.pool.take(self.states, req.state_row, req.num_computed)
            if ckpt is not None:
                req.pending.append(ckpt)
