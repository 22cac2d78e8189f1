"""Continuous batching: admission by KV capacity, prefill before decode, chunked prefill.

Pure Python over Request objects; the runner turns a schedule into a forward step.
Each admitted request reserves its whole budget (prompt + max_tokens) of KV slots, so a running
request never waits for memory and nothing is preempted.
"""
from __future__ import annotations

from collections import deque

from freetoken.engine.request import InvalidRequest, Request, Status


class Scheduler:
    def __init__(self, kv_pool, max_running: int, chunk_size: int, max_model_len: int):
        self.kv = kv_pool
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
                batch.append((req, n))
                room -= n
        if batch:
            return batch
        return [(req, 1) for req in self.running]

    def _admit(self) -> None:
        reserved = sum(self.budget(r) - len(r.slots) for r in self.running)
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.budget(req)
            if reserved + need > self.kv.num_free:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            reserved += need

    def finish(self, req: Request, reason: str) -> None:
        """Release everything the request holds; safe to call twice."""
        if req.status is Status.FINISHED:
            return
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.slots)
        req.slots = []
