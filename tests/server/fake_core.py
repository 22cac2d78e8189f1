"""A stand-in for EngineCore with the same surface (add_request, step, abort, has_work, scheduler,
kv, moe, tokenizer, rebuild_cache) but a scripted "model", so the server can be tested without
the real model. It uses the real Scheduler, KVPool and TextStream.

The reply is chosen by directives in the last user turn (or the raw prompt):
  SAY:<text>     reply exactly <text> (then end of sequence)
  REPEAT:<n>     reply "tok " n times
  SLEEP:<ms>     every step that runs this request sleeps <ms> milliseconds
  FAIL           every step that runs this request raises
  ECHO           reply the whole prompt text (shows what the chat template rendered), with
                 <tool_call> tags written [tool_call] so that they are not parsed as calls
Anything else: "You said: <first 40 characters>".
"""
from __future__ import annotations

import re
import time

import numpy as np

from freetoken.engine.core import Delta
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.request import Request, SamplingParams
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.stop import TextStream

_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


class _Detok:
    """The engine's TextStream pushes tokens; the tokenizer's detokenizer adds them."""

    def __init__(self, inner):
        self.inner = inner

    def push(self, token_id):
        return self.inner.add(token_id)

    add = push

    def flush(self):
        return self.inner.flush()


class FakeMoE:
    def __init__(self):
        self.counters = {"hits": 0, "misses": 0, "fills": 0, "cpu_execs": 0, "evictions": 0}

    def stats(self) -> dict:
        return {"total": dict(self.counters), "layers": [dict(self.counters)]}


class FakeCore:
    def __init__(self, tokenizer, max_model_len=2048, kv_tokens=4 * 2048, max_running=4, chunk=8192,
                 load_seconds=0.0):
        time.sleep(load_seconds)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_running, self.chunk = max_running, chunk
        self.kv = KVPool(1, kv_tokens, 1, 1, np.float32)
        self.scheduler = Scheduler(self.kv, max_running, chunk, max_model_len)
        self.moe = FakeMoE()
        self.eos_ids = frozenset(tokenizer.stop_token_ids)
        self.eos = min(self.eos_ids)
        self._streams: dict[str, TextStream] = {}
        self._scripts: dict[str, tuple[list[int], float, bool]] = {}
        self.rebuilds = 0

    def add_request(self, prompt_ids, params: SamplingParams, rid=None) -> Request:
        req = Request(prompt_ids=list(prompt_ids), params=params)
        if rid is not None:
            req.rid = rid
        self.scheduler.add(req)
        self._streams[req.rid] = TextStream(_Detok(self.tokenizer.detokenizer()), params.stop)
        self._scripts[req.rid] = self._script(prompt_ids)
        return req

    def _script(self, prompt_ids):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turns = _USER.findall(text)
        said = turns[-1] if turns else text
        sleep = float(m.group(1)) / 1000 if (m := re.search(r"SLEEP:(\d+)", said)) else 0.0
        if "ECHO" in said:
            reply = self.tokenizer.decode(prompt_ids)           # without <|im_end|>: that would end it
            reply = reply.replace("<tool_call>", "[tool_call]").replace("</tool_call>", "[/tool_call]")
        elif (m := re.search(r"SAY:(.*)", said, re.S)):
            reply = m.group(1)
        elif (m := re.search(r"REPEAT:(\d+)", said)):
            reply = "tok " * int(m.group(1))
        else:
            reply = "You said: " + said[:40]
        return self.tokenizer.encode(reply) + [self.eos], sleep, "FAIL" in said

    def abort(self, req: Request) -> None:
        self.scheduler.finish(req, "abort")
        self._streams.pop(req.rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Delta]:
        schedule = self.scheduler.schedule()
        if not schedule:
            return []
        scripts = [self._scripts[req.rid] for req, _ in schedule]
        time.sleep(max(s[1] for s in scripts))
        if any(s[2] for s in scripts):
            raise RuntimeError("scripted failure")
        deltas = []
        for req, n in schedule:
            req.slots.extend(self.kv.alloc(n))
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                script = self._scripts[req.rid][0]
                k = len(req.output_ids)
                deltas.append(self._append(req, script[k] if k < len(script) else self.eos))
        return deltas

    def _append(self, req: Request, token: int) -> Delta:
        """As EngineCore._append."""
        req.output_ids.append(token)
        stream = self._streams[req.rid]
        stop_id = token in req.params.stop_token_ids or (token in self.eos_ids and not req.params.ignore_eos)
        text = "" if stop_id else stream.push(token)
        reason = None
        if stop_id or stream.stopped_by is not None:
            reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.scheduler.budget(req):
            reason = "length"
        if reason:
            text += stream.finish()
        req.text = stream.text
        if reason:
            self.scheduler.finish(req, reason)
            del self._streams[req.rid]
            del self._scripts[req.rid]
        return Delta(req, [token], text, reason is not None)

    def close(self) -> None:
        self.closed = True

    def rebuild_cache(self, moe_cache_size=None, num_kv_tokens=None) -> dict:
        if num_kv_tokens is not None and num_kv_tokens < 16:
            raise ValueError(f"num_kv_tokens {num_kv_tokens} is below the minimum of 16")
        if moe_cache_size is not None and moe_cache_size > 1000:
            raise ValueError(f"moe_cache_size {moe_cache_size} exceeds the 1000 experts of the model")
        if num_kv_tokens is not None:
            self.kv = KVPool(1, num_kv_tokens, 1, 1, np.float32)
            self.scheduler = Scheduler(self.kv, self.max_running, self.chunk, self.max_model_len)
        self.rebuilds += 1
        return {"kv_slots": self.kv.num_slots, "moe_cache_size": moe_cache_size}
