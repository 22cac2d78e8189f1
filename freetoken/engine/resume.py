"""The recurrent-state seam of the Scheduler: one object it calls at every point of a request's
life, whatever the model. Attention-only models get NoRecurrentState (every call a no-op); a GDN
model gets StateRows (a recurrent-state row per running request) and, with a prefix cache, a
Resumer: requests resume from the deepest cached prefix that has a recurrent-state checkpoint, the
prefill forward captures the state at each anchor it passes (state cuts), and those checkpoints are
linked to the tree once the prompt's KV is in it (at the end of prefill) or when the request
finishes (the state after everything it computed). engine/build.py picks one.
"""
from __future__ import annotations

from bisect import bisect_right

ANCHORS_PER_PROMPT = 16    # checkpoints one prompt's prefill may take, besides its end
MIN_ANCHOR_GAP = 8         # tokens; of two anchors closer than this only the later one is kept


class NoRecurrentState:
    """An attention-only model: the KV pool is the whole state of a request."""

    def add(self, req) -> None:
        """A request was queued."""

    def admit(self, req) -> None:
        """The request starts running."""

    def reuse(self, req) -> bool:
        """Take a cached prefix for req; False: the Scheduler's own KV prefix match serves."""
        return False

    def cuts(self, req, n: int) -> list:
        """(offset, sink) of each state the forward of req's next n prompt tokens captures."""
        return []

    def link(self, req, tokens) -> None:
        """`tokens` of req are in the prefix tree now."""

    def sampled(self, req, token: int) -> None:
        """Decode sampled `token` for req."""

    def finish(self, req, reason: str) -> None:
        """The request ended (before its KV is released)."""

    def settle(self, req, tokens) -> None:
        """After finish: what req computed is in the tree (`tokens`); drop what found no node."""


class StateRows(NoRecurrentState):
    """A GDN or sliding-window model without a prefix cache: one state row per running request."""

    def __init__(self, states):
        self.states = states

    def admit(self, req) -> None:
        req.state_row = self.states.alloc()      # one row per running request: always free

    def finish(self, req, reason: str) -> None:
        if req.state_row is not None:
            self.states.free(req.state_row)
            req.state_row = None


class Resumer(StateRows):
    """A GDN or sliding-window model with a prefix cache: resume at checkpoints, capture at anchors,
    link to the tree."""

    def __init__(self, cache, pool, states, anchors):
        super().__init__(states)
        self.cache, self.pool, self.anchors = cache, pool, anchors

    def add(self, req) -> None:
        """Every anchor of the prompt, one of any two closer than MIN_ANCHOR_GAP (the later: a
        tool result's end and its turn's end are one token apart, and each checkpoint costs a copy
        of the whole state and a place in the budget), and the prompt's end. Which of them are checkpointed is
        decided once the resume point is known (reuse)."""
        kept: list[int] = []
        for p in self.anchors.positions(req.prompt_ids):
            if kept and p - kept[-1] < MIN_ANCHOR_GAP:
                kept[-1] = p
            else:
                kept.append(p)
        req.anchor_candidates = kept + [len(req.prompt_ids)]
        req.anchors = list(req.anchor_candidates)
        req.ends_a_query = self.anchors.ends_a_query(req.prompt_ids)

    def _select(self, req) -> None:
        """The anchors past the resume point this prefill checkpoints: the first and the last
        ANCHORS_PER_PROMPT / 2. Harnesses edit just past the previous edit (the tool output that
        leaves the window next, the thinking of the turn before) and near the recent end, and a
        real model's checkpoint costs tens of MiB, so the middle of a long recompute is skipped."""
        ahead = [p for p in req.anchor_candidates[:-1] if p > req.num_computed]
        half = ANCHORS_PER_PROMPT // 2
        if len(ahead) > ANCHORS_PER_PROMPT:
            ahead = ahead[:half] + ahead[-half:]
        req.anchors = ahead + req.anchor_candidates[-1:]

    def reuse(self, req) -> bool:
        """Take the deepest resumable cached prefix of all but the last prompt token (locked)."""
        if req.params.prompt_logprobs is not None:    # needs every position's logits
            slots, node = [], self.cache.root
        else:
            slots, node = self.cache.match_resumable(req.prompt_ids[:-1])
        self.cache.lock(node)
        req.lock_node, req.slots = node, list(slots)
        req.num_computed = req.num_cached = len(slots)
        req.resume = node.checkpoint if slots else None
        self._select(req)
        return True

    def admit(self, req) -> None:
        """The request gets its state row and the checkpoint it resumes from (else it is zero)."""
        super().admit(req)
        if req.resume is not None:
            self.pool.restore(req.resume, self.states, req.state_row)
            req.resume = None

    def cuts(self, req, n: int) -> list:
        """(offset in the chunk, sink) for each anchor the chunk of n tokens from req.num_computed
        reaches: its checkpoint is filled by that forward (models/state_cuts.py), one forward
        however many anchors the chunk spans, and is pending from now on."""
        if req.state_row is None:
            return []
        lo, hi = req.num_computed, req.num_computed + n
        out = []
        for p in req.anchors[bisect_right(req.anchors, lo):bisect_right(req.anchors, hi)]:
            ckpt = self.pool.blank(self.states, p) if p > req.num_cached else None
            if ckpt is not None:
                ckpt.keep = req.ends_a_query and p == len(req.prompt_ids)
                req.pending.append(ckpt)
                out.append((p - lo, self.pool.sink(ckpt, self.states)))
        return out

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
                self.pool.discard(ckpt)
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

    def settle(self, req, tokens) -> None:
        """Link what the finished request computed; discard the checkpoints that never got a node
        (beyond what it computed)."""
        self.link(req, tokens)
        for ckpt in req.pending:
            self.pool.discard(ckpt)
        req.pending = []

    def finish(self, req, reason: str) -> None:
        """A completed request leaves the state after everything it computed (the next turn of a
        conversation extends exactly that); then its row is freed."""
        if reason in ("stop", "length") and req.state_row is not None and req.num_computed > 0:
            ckpt = self.pool.take(self.states, req.state_row, req.num_computed)
            if ckpt is not None:
                req.pending.append(ckpt)
        super().finish(req, reason)
