"""LLM: the embedding API. ``LLM(model_dir).generate(prompts, SamplingParams())``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from freetoken.config import EngineConfig
from freetoken.engine.request import SamplingParams


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    logprobs: list | None = None          # TokenLogprob per output token (params.logprobs set)
    prompt_logprobs: list | None = None   # None first, then one per prompt token (params.prompt_logprobs)


class LLM:
    """Load a model once, then generate. Keywords are EngineConfig fields (unknown ones raise)."""

    def __init__(self, model: str | None = None, **engine_options):
        from freetoken.engine.core import EngineCore
        self.config = EngineConfig(model=model, **engine_options)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer

    def encode_prompt(self, prompt) -> list[int]:
        """A string is tokenized as is (no chat template); a list of ints is taken as token ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        return self.tokenizer.encode(text)

    def generate(self, prompts, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run a batch of prompts (str, token-id lists, or one of either) to completion."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        outs, reqs = {}, []
        try:
            for p in prompts:
                reqs.append(self.core.add_request(self.encode_prompt(p), params))
        except Exception:
            for r in reqs:        # all or nothing: do not leave half a batch queued
                self.core.abort(r)
            raise
        for rid, out in self._drive(reqs):
            outs[rid] = out
        return [outs[r.rid] for r in reqs]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt as they are generated; ``last_output`` holds the result."""
        req = self.core.add_request(self.encode_prompt(prompt), params or SamplingParams())
        self.last_output = None
        try:
            for delta in self._deltas([req]):
                if delta.text:
                    yield delta.text
        finally:
            if req.finish_reason is None:     # the consumer stopped early (e.g. Ctrl-C)
                self.core.abort(req)
        self.last_output = self._output(req)

    def _deltas(self, reqs):
        pending = {r.rid for r in reqs}
        t0 = time.perf_counter()
        for r in reqs:
            r.metrics = {"t_start": t0}
        while pending:
            for delta in self.core.step():
                req = delta.request
                if req.rid in pending and "t_first" not in req.metrics:
                    req.metrics["t_first"] = time.perf_counter()
                if delta.finished:
                    req.metrics["t_end"] = time.perf_counter()
                    pending.discard(req.rid)
                yield delta

    def _drive(self, reqs):
        for delta in self._deltas(reqs):
            if delta.finished:
                yield delta.request.rid, self._output(delta.request)

    def _output(self, req) -> RequestOutput:
        m = req.metrics
        n_out = len(req.output_ids)
        prefill_s = m.get("t_first", m["t_start"]) - m["t_start"]
        decode_s = m.get("t_end", m["t_start"]) - m.get("t_first", m["t_start"])
        metrics = {"prompt_tokens": len(req.prompt_ids), "generated_tokens": n_out,
                   "prefill_s": prefill_s, "decode_s": decode_s,
                   "prefill_tok_s": len(req.prompt_ids) / prefill_s if prefill_s > 0 else 0.0,
                   "decode_tok_s": (n_out - 1) / decode_s if decode_s > 0 and n_out > 1 else 0.0}
        p = req.params
        return RequestOutput(req.prompt_ids, list(req.output_ids), req.text, req.finish_reason, metrics,
                             list(req.output_logprobs) if p.logprobs is not None else None,
                             list(req.prompt_logprobs) if p.prompt_logprobs is not None else None)

    def stats(self) -> dict:
        """MoE cache counters (per layer and total), KV pool occupancy."""
        kv = self.core.kv
        return {"moe": self.core.moe.stats(), "kv": {"slots": kv.num_slots, "free": kv.num_free}}
