"""Continuous batching: admission by KV capacity, prefill before decode, chunked prefill.

Pure Python over Request objects; the runner turns a schedule into a forward step.
Each admitted request reserves its whole budget (prompt + max_tokens) of KV slots, so a running
request never waits for memory and nothing is preempted. With a prefix cache, a new request reuses
the KV of the longest cached prefix of its prompt (all but the last token, which is always
recomputed so there are logits to sample from), and finished requests leave their KV in the tree.
"""
from __future__ import annotations

from collections import deque

from freetoken.engine.request import InvalidRequest, Request, Status
from freetoken.engine.resume import NoRecurrentState

PROMPT_LOGPROB_ROWS = 512   # prompt positions per step of a request that wants their logprobs


class Scheduler:
    def __init__(self, kv_pool, max_running: int, chunk_size: int, max_model_len: int, prefix_cache=None,
                 recurrent=None):
        self.kv, self.cache = kv_pool, prefix_cache
        self.recurrent = recurrent or NoRecurrentState()   # state rows/checkpoints (GDN, windows): resume.py
        self.max_running, self.chunk_size, self.max_model_len = max_running, chunk_size, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def budget(self, req: Request) -> int:
        """KV slots a request may use in total: prompt plus its output budget, capped by the
        context length and the pool (generation then ends with finish_reason "length")."""
        return min(len(req.prompt_ids) + req.params.max_tokens, self.max_model_len, self.kv.num_slots)

    def check(self, req: Request) -> None:
        """Reject what can never run, with the token counts; nothing is silently truncated."""
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {n} tokens but the context length is "
                                 f"{self.max_model_len} (at least one token must be generated)")
        if n + 1 > self.kv.num_slots:
            raise InvalidRequest(f"the prompt has {n} tokens but the KV pool holds "
                                 f"{self.kv.num_slots} tokens")

    def add(self, req: Request) -> None:
        self.check(req)
        self.recurrent.add(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Next step: a prefill batch if any prompt needs computing, else one decode token each."""
        self._admit()
        batch, room = [], self.chunk_size
        for req in self.running:
            if req.in_prefill and room > 0:
                n = min(len(req.prompt_ids) - req.num_computed, room)
                if req.params.prompt_logprobs is not None:   # bounds its [n, V] logits rows
                    n = min(n, PROMPT_LOGPROB_ROWS)
                batch.append((req, n))
                room -= n
        if batch:
            return batch
        return [(req, 1) for req in self.running]

    def available(self) -> int:
        """KV slots that can be handed out: free ones plus evictable cached ones."""
        return self.kv.num_free + (self.cache.evictable_size if self.cache else 0)

    def _admit(self) -> None:
        reserved = sum(self.budget(r) - len(r.slots) for r in self.running)
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            self._reuse_prefix(req)
            need = self.budget(req) - len(req.slots)
            if reserved + need > self.available():
                self._drop_prefix(req)
                break
            self.waiting.popleft()
            self.recurrent.admit(req)
            req.status = Status.RUNNING
            self.running.append(req)
            reserved += need

    def _reuse_prefix(self, req: Request) -> None:
        if self.cache is None or self.recurrent.reuse(req):
            return
        if req.params.prompt_logprobs is not None:   # needs every position's logits: reuses nothing,
            req.lock_node = self.cache.root          # but its prompt is cached like any other
            return
        slots, node = self.cache.match(req.prompt_ids[:-1])
        self.cache.lock(node)
        req.lock_node, req.slots = node, list(slots)
        req.num_computed = req.num_cached = len(slots)

    def _drop_prefix(self, req: Request) -> None:
        if self.cache is not None and req.lock_node is not None:
            self.cache.unlock(req.lock_node)
            req.lock_node, req.slots, req.num_computed, req.num_cached = None, [], 0, 0
            req.resume = None

    def cache_prompt(self, req: Request) -> None:
        """Put a prompt whose prefill just ended into the tree while its request runs on, so
        requests that share it (n > 1 choices, agents fanning out) reuse its KV now rather than
        after this one finishes. The request then holds the tree's slots for those positions."""
        if self.cache is None or req.lock_node is None:
            return
        n = len(req.prompt_ids)
        dups = self.cache.insert(req.prompt_ids, req.slots[:n])
        slots, node = self.cache.match(req.prompt_ids)
        self.cache.lock(node)
        self.cache.unlock(req.lock_node)
        req.lock_node, req.slots[:n] = node, slots
        req.slot_row_len = 0       # rewritten in place: the runner's int32 copy is stale
        self.kv.free(dups)         # positions another request had cached meanwhile: its copy is kept
        self.recurrent.link(req, req.prompt_ids)

    def checkpoint_sampled(self, req: Request, token: int) -> None:
        """After decode sampled `token` for req (GDN models: the state before a tool-call opener)."""
        if not req.in_prefill:
            self.recurrent.sampled(req, token)

    def state_cuts(self, req: Request, n: int) -> list:
        """(offset, sink) of each state the forward of req's next n prompt tokens should capture
        (GDN models: the anchors it passes, engine/resume.py); empty otherwise."""
        return self.recurrent.cuts(req, n) if req.in_prefill else []

    def alloc(self, n: int) -> list[int]:
        """n KV slots, evicting unlocked cached prefixes when the free list runs short."""
        short = n - self.kv.num_free
        if short > 0 and self.cache is not None:
            self.kv.free(self.cache.evict(short))
        return self.kv.alloc(n)

    def finish(self, req: Request, reason: str) -> None:
        """Release everything the request holds; safe to call twice."""
        if req.status is Status.FINISHED:
            return
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.recurrent.finish(req, reason)
        slots = req.slots
        if self.cache is not None and req.lock_node is not None:
            # Keep what was computed for later requests; free the slots the tree already had.
            done = req.num_computed
            self.kv.free(self.cache.insert(req.all_ids[:done], slots[:done]) + slots[done:])
            self.recurrent.settle(req, req.all_ids[:done])
            self.cache.unlock(req.lock_node)
            req.lock_node = None
        else:
            self.kv.free(slots)
        req.slots = []
