"""EngineCore: loads a model and advances all requests one forward step at a time.

Single-threaded and synchronous; the server's engine thread and ``LLM.generate`` both drive it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from freetoken.config import EngineConfig
from freetoken.engine import build
from freetoken.engine.facts import after_loading, probe_gpu
from freetoken.engine.plan import compute_backend, make_plan
from freetoken.engine.plan_checks import check_config
from freetoken.engine.request import InvalidRequest, Request, SamplingParams
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.stop import TextStream
from freetoken.log import logger


@dataclass
class Delta:
    """What one step produced for one request."""

    request: Request
    token_ids: list[int]
    text: str
    finished: bool
    logprobs: list = None        # TokenLogprob per token id when the request asked for them


class EngineCore:
    _tuner = None          # the cpu backend's ThreadTuner, set after the warm-up (engine/thread_tuner.py)

    def __init__(self, config: EngineConfig):
        """Plan, then build: load the model, measure the facts, settle every size and backend in one
        plan (engine/plan.py, logged as one summary), build what it says, warm up."""
        from freetoken.backend import get_ops
        from freetoken.models.loader import load_model
        from freetoken.models.requantize import quantize_experts
        self.config = config
        check_config(config)                      # a bad flag fails before CuPy or the model loads
        facts = probe_gpu(config)
        compute_backend(config.backend, facts)    # so does --backend cuda without a GPU
        loaded = load_model(config.model, logger)
        self.model_name, self.model_dir = loaded.name, loaded.path
        self.model_config = cfg = loaded.config
        self.tokenizer, weights = loaded.tokenizer, loaded.weights
        del loaded                                # the dense experts go once the quantized ones replace them
        self.weights = quantize_experts(weights, cfg.moe_layers, config.quantize_experts, logger)
        del weights
        self._grammars = self._start_grammars()    # on a thread, overlapping the rest of start-up
        self.facts = after_loading(facts, self.weights, cfg.moe_layers)
        self.plan = make_plan(cfg, config, self.facts)
        self.max_model_len = self.plan.context_len      # a resize never changes it
        self.ops = get_ops(self.plan.compute, cpu_dots=config.cpu_dots, fused_decode=config.cpu_decode_layer)
        self.weights = build.place_weights(self.ops, self.weights, config)
        self.moe = self._make_moe()                # plans again if pinning the host pool failed
        _log_plan(self.plan)
        build.prepare_host(self.ops, config, cfg)
        self.states = build.make_states(cfg, self.plan, self.ops.xp, config.chunked_prefill_size)
        self.checkpoints, self._anchors = build.checkpoint_pool(self.plan, config, self.ops, self.tokenizer)
        self._assemble(build.make_kv_pool(cfg, self.plan, self.ops.xp), self.moe)
        self._streams: dict[str, TextStream] = {}
        self._seeds = np.random.default_rng(config.seed)
        self.eos_ids = frozenset(self.tokenizer.stop_token_ids)
        self.warmup()                       # no tuner yet: the warm-up's steps are compiles
        self._tuner = self._make_tuner()
        if self._grammars is not None:      # built before serving: the build holds the GIL
            self._grammars.join()

    def _assemble(self, kv, moe) -> None:
        """What holds the KV pool, built together (again after a KV resize): the model (over `moe`,
        the runtime or a routing recorder around it), the prefix cache, the scheduler with its
        recurrent-state seam, the forward."""
        self.kv = kv
        self.model = build.make_model(self.model_config, self.weights, self.ops, moe, kv, self.states)
        self.prefix_cache = build.prefix_cache(self.plan, self.checkpoints)
        recurrent = build.recurrent_seam(self.states, self.prefix_cache, self.checkpoints, self._anchors)
        self.scheduler = Scheduler(kv, self.config.max_running_requests, self.config.chunked_prefill_size,
                                   self.plan.context_len, self.prefix_cache, recurrent)
        self.forward = self._make_forward()

    def warmup(self) -> None:
        """Run one tiny request through prefill and decode so kernels are compiled (numba JIT on
        first use) before the first real request; then forget it (counters, prefix cache)."""
        t0 = time.perf_counter()
        logger.info("warm-up forward")
        req = self.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        with self._compile_watch():
            while req.finish_reason is None:
                self.step()
        self.moe.reset()
        if self.prefix_cache is not None:
            self.kv.free(self.prefix_cache.evict(self.prefix_cache.size))
        logger.info("warm-up forward done in %.2f s", time.perf_counter() - t0)

    def _make_tuner(self):
        """The CPU backend's compute-thread tuner (engine/thread_tuner.py), or None."""
        if self.ops.name != "cpu" or not self.config.thread_tuning:
            return None
        from freetoken.engine.thread_tuner import ThreadTuner
        from freetoken.kernels._numba import load_numba
        numba = load_numba()
        return ThreadTuner(numba.get_num_threads(), numba.set_num_threads, logger)

    def _compile_watch(self):
        """Progress of the numba compiles the warm-up triggers (CPU kernels: any backend's MoE
        CPU branch and sampling use them); nothing to watch on the ref backend."""
        import contextlib
        if self.ops.name == "ref":
            return contextlib.nullcontext()
        from freetoken.kernels.compile_watch import watch_compiles
        kind = "gdn" if self.model_config.has_gdn else "moe"
        return watch_compiles(logger, f"{kind}/{self.facts.weights_dtype}")

    def _start_grammars(self):
        """grammar.Grammars with its llguidance tokenizer building in the background (it logs
        whether constrained decoding is on), or None without the grammar extra (logged here)."""
        from freetoken import grammar
        if not grammar.available():
            logger.info("constrained decoding: off (llguidance is not installed; %s enforces JSON output "
                        "formats and forced tool choices)", grammar.INSTALL_HINT)
            return None
        grammars = grammar.Grammars(self.tokenizer.to_json(), self.model_config.vocab_size,
                                    self.tokenizer.stop_token_ids)
        grammars.build_in_background(logger)
        return grammars

    def _make_moe(self):
        """The MoE runtime the plan describes, over this backend's device. Pinning the host expert
        pool is the one start-up fact learnt by trying: when it fails, the plan is made again."""
        from freetoken.moe.device import device_for
        from freetoken.moe.runtime import CACHED, build_moe, host_pool_for
        cfg = self.model_config
        banks = [(self.weights.layers[i].gate_up, self.weights.layers[i].down) for i in cfg.moe_layers]
        dev = device_for(self.ops.name)
        pool = getattr(self, "host_pool", None) or banks      # pinned once; later runtimes reuse it
        self.host_pool = host_pool_for(cfg, pool, self.plan.moe, dev, logger)
        if self.plan.moe.backend in CACHED and dev.needs_pinning and not self.host_pool.pinned:
            self.facts = replace(self.facts, host_pinned=False)
            self.plan = make_plan(cfg, self.config, self.facts)
        biases = [(self.weights.layers[i].gate_up_bias, self.weights.layers[i].down_bias)
                  for i in cfg.moe_layers] if cfg.expert_bias else None
        return build_moe(cfg, self.host_pool, self.plan.moe, self.ops.experts, logger, dev=dev,
                         cpu_dots=self.config.cpu_dots, biases=biases)

    def record_routing(self) -> None:
        """From now on, record every decode MoE layer call's routed ids (see moe/trace.py)."""
        from freetoken.moe.trace import RecordingMoE, RoutingRecorder
        cfg = self.model_config
        self.recorder = RoutingRecorder(len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok,
                                        model=self.model_name)
        self.model.moe = RecordingMoE(self.moe, self.recorder)

    def save_routing(self, path) -> None:
        self.recorder.save(path)
        logger.info("routing trace written to %s", path)

    def cache_status(self) -> dict:
        from freetoken.engine.rebuild import cache_status
        return cache_status(self)

    def rebuild_cache(self, moe_cache_size: int | None = None, num_kv_tokens: int | None = None) -> dict:
        """Resize the expert cache and/or KV pool while idle: the plan again with a Resize, then
        rebuild(plan). RebuildRejected (the old geometry serving) when it cannot be met."""
        from freetoken.engine.rebuild import resize_plan
        return self.rebuild(resize_plan(self, moe_cache_size, num_kv_tokens))

    def rebuild(self, plan) -> dict:
        """Replace what a new plan changes (expert slots, the KV pool and what holds it) at an idle
        point; on failure the old geometry keeps serving (engine/rebuild.py)."""
        from freetoken.engine.rebuild import rebuilt
        kv = rebuilt(self, plan)
        old, self.plan = self.plan, plan
        for d in [d for d in plan.decisions if d not in old.decisions]:    # what the resize decided anew
            logger.info("plan: %s %s (%s)", d.name, d.value, d.why)
        if kv is not None:
            if self.checkpoints is not None:
                self.checkpoints.clear()          # they hang from the old tree's nodes
            self._assemble(kv, self.model.moe)
        logger.info("cache rebuilt: expert cache %d slots, KV pool %d tokens", plan.moe.slots, self.kv.num_slots)
        return self.cache_status()

    def close(self) -> None:
        """Join the MoE executor and grammar threads, unpin host memory; the engine is unusable
        afterwards."""
        if getattr(self, "_grammars", None) is not None:
            self._grammars.join()
        if self._tuner is not None:         # numba's count is per thread: give the caller's back
            self._tuner.restore()
        self.moe.close()
        if getattr(self, "host_pool", None) is not None:
            self.host_pool.close()

    # --- requests -------------------------------------------------------------------------

    @property
    def grammars(self):
        """The model's grammar.Grammars: the one start-up built, else one built now (its
        tokenizer on first use)."""
        if getattr(self, "_grammars", None) is None:
            from freetoken.grammar import Grammars
            self._grammars = Grammars(self.tokenizer.to_json(), self.model_config.vocab_size,
                                      self.tokenizer.stop_token_ids)
        return self._grammars

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        vocab = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab})")
        matcher = None
        if params.grammar is not None:
            from freetoken.grammar import GrammarError, GrammarUnavailable
            try:
                matcher = self.grammars.matcher(params.grammar)
            except (GrammarError, GrammarUnavailable) as e:
                raise InvalidRequest(str(e)) from None
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        req = Request(prompt_ids=list(prompt_ids), params=params, rng=np.random.default_rng(seed),
                      matcher=matcher)
        if rid is not None:
            req.rid = rid
        self.scheduler.add(req)
        self._streams[req.rid] = TextStream(self.tokenizer.detokenizer(params.skip_special_tokens), params.stop)
        return req

    def abort(self, req: Request) -> None:
        self.scheduler.finish(req, "abort")
        self._streams.pop(req.rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Delta]:
        schedule = self.scheduler.schedule()
        if not schedule:
            return []
        prefilling = [req for req, _ in schedule if req.in_prefill]
        t0 = time.perf_counter()
        reqs, tokens, lps = self._forward(schedule)
        if self._tuner is not None and not prefilling:
            self._tuner.observe(time.perf_counter() - t0, len(schedule))
        for req in prefilling:
            if not req.in_prefill:
                self.scheduler.cache_prompt(req)
        for req, tok in zip(reqs, tokens):
            self.scheduler.checkpoint_sampled(req, int(tok))
        return [self._append(req, int(tok), lp) for req, tok, lp in zip(reqs, tokens, lps)]

    def _forward(self, schedule):
        """Model forward + sampling: (requests that sampled, their token ids)."""
        from freetoken.engine.runner import run_step
        return run_step(self.forward, self.ops, schedule, self.scheduler.alloc, self.scheduler.state_cuts)

    def _make_forward(self):
        """Host batch -> logits: the model itself on numpy backends; on CUDA, decode steps replay
        captured graphs when the plan has them on."""
        if self.ops.name != "cuda":
            return self.model.forward
        from freetoken.engine.graphs import DecodeGraphs
        graphs = DecodeGraphs(self.model, self.ops, self.config.max_running_requests,
                              self.plan.context_len, enabled=self.plan.cuda_graphs)
        graphs.capture_all(logger)      # before any request: capture writes dummy KV rows
        self.graphs = graphs
        return graphs.forward

    def _append(self, req: Request, token: int, logprob=None) -> Delta:
        req.output_ids.append(token)
        req.output_counts[token] = req.output_counts.get(token, 0) + 1
        if logprob is not None:
            req.output_logprobs.append(logprob)
        stream = self._streams[req.rid]
        stop_id = token in req.params.stop_token_ids or (token in self.eos_ids and not req.params.ignore_eos)
        grammar_done = False
        if req.matcher is not None:     # the mask allowed the token, so the grammar takes it
            req.matcher.consume(token)
            grammar_done = req.matcher.stopped     # only the end may follow (or it was the end)
            stop_id = stop_id or (grammar_done and token in self.eos_ids)
        text = "" if stop_id else stream.push(token)
        reason = None
        if stop_id or grammar_done or stream.stopped_by is not None:
            reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.scheduler.budget(req):
            reason = "length"
        if reason:
            text += stream.finish()
        req.text, req.stopped_by = stream.text, stream.stopped_by
        if reason:
            self.scheduler.finish(req, reason)
            del self._streams[req.rid]
        return Delta(req, [token], text, reason is not None, None if logprob is None else [logprob])


def _log_plan(plan) -> None:
    """The plan as one summary; each fallback also as a warning of its own."""
    logger.info("%s", plan.summary())
    for line in plan.warnings:
        logger.warning("%s", line)
