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

import dataclasses
import re
import time

from types import SimpleNamespace

import numpy as np

from freetoken.engine.core import EngineCore
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.request import Request, SamplingParams
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.stop import TextStream

# a user turn in the Qwen3-style template, or harmony's last one (tests/fixtures/harmony/: up to the
# generation prompt, so that a SAY: text may hold harmony's own markers)
_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>"
                   r"|<\|start\|>user<\|message\|>((?:(?!<\|start\|>user<\|message\|>).)*)<\|end\|><\|start\|>assistant$", re.S)


class FakeMoE:
    def __init__(self):
        self.counters = {"hits": 0, "misses": 0, "fills": 0, "cpu_execs": 0, "evictions": 0}

    def stats(self) -> dict:
        return {"total": dict(self.counters), "layers": [dict(self.counters)]}


class FakeCore(EngineCore):
    """EngineCore with its request handling, scheduler and KV pool, but a scripted forward."""

    def __init__(self, tokenizer, max_model_len=2048, kv_tokens=4 * 2048, max_running=4, chunk=8192,
                 load_seconds=0.0):
        time.sleep(load_seconds)
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(vocab_size=tokenizer.vocab_size)   # what add_request checks ids against
        self.max_model_len = max_model_len
        self.max_running, self.chunk = max_running, chunk
        self.kv = KVPool(1, kv_tokens, 1, 1, np.float32)
        self.prefix_cache = None
        self.scheduler = Scheduler(self.kv, max_running, chunk, max_model_len)
        self.moe = FakeMoE()
        self.eos_ids = frozenset(tokenizer.stop_token_ids)
        self.eos = min(self.eos_ids)
        self._streams: dict[str, TextStream] = {}
        self._seeds = np.random.default_rng(0)
        self._scripts: dict[str, tuple[list[int], float, bool]] = {}
        self.rebuilds = 0

    def add_request(self, prompt_ids, params: SamplingParams, rid=None) -> Request:
        # the script is the output: a grammar is not applied (tests/server/test_structured_output.py
        # runs the real engine)
        req = super().add_request(prompt_ids, dataclasses.replace(params, grammar=None), rid)
        self._scripts[req.rid] = self._script(prompt_ids)
        return req

    def _script(self, prompt_ids):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turns = ["".join(groups) for groups in _USER.findall(text)]
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

    def _forward(self, schedule):
        """The scripted "model": the next token of each request's script."""
        scripts = [self._scripts[req.rid] for req, _ in schedule]
        time.sleep(max(s[1] for s in scripts))
        if any(s[2] for s in scripts):
            raise RuntimeError("scripted failure")
        reqs, tokens = [], []
        for req, n in schedule:
            req.slots.extend(self.scheduler.alloc(n))
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                script = self._scripts[req.rid][0]
                k = len(req.output_ids)
                reqs.append(req)
                tokens.append(script[k] if k < len(script) else self.eos)
        return reqs, tokens, [None] * len(reqs)      # no logits: no logprobs

    def cache_status(self) -> dict:
        return {"kv": {"num_tokens": self.kv.num_slots, "free": self.kv.num_free}}

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
