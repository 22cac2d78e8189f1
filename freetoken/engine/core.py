"""EngineCore: loads a model and advances all requests one forward step at a time.

Single-threaded and synchronous; the server's engine thread and ``LLM.generate`` both drive it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from freetoken.config import EngineConfig
from freetoken.engine.gpu_budget import context_len
from freetoken.engine import build
from freetoken.engine.request import InvalidRequest, Request, SamplingParams, Status
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.stop import TextStream
from freetoken.log import logger
from freetoken.cupy_loader import cupy as load_cupy



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
        from freetoken.backend import get_ops, resolve_backend
        from freetoken.models.loader import load_model

        self.config = config
        backend, why = resolve_backend(config.backend)
        logger.info("backend %s (%s)", backend, why)
        self.ops = get_ops(backend)
        loaded = load_model(config.model, logger)
        self.model_name, self.model_dir = loaded.name, loaded.path
        self.model_config = cfg = loaded.config
        self.tokenizer, self.weights = loaded.tokenizer, loaded.weights
        self._grammars = self._start_grammars()    # on a thread, overlapping the rest of start-up
        self.max_model_len = context_len(cfg, config)
        if self.max_model_len > cfg.max_position_embeddings:
            logger.warning("--max-model-len %d is beyond the %d positions the model was trained on "
                           "(max_position_embeddings): it runs, but output quality past %d tokens is not "
                           "guaranteed", self.max_model_len, cfg.max_position_embeddings,
                           cfg.max_position_embeddings)
        self._plan_gpu_memory()                       # before anything is placed on the device
        self.weights = build.place_weights(self.ops, self.weights)
        self.kv = self._make_kv_pool()
        self.states = build.make_states(cfg, self.config, self.ops.xp)
        self.moe = self._make_moe()
        self.model = build.make_model(cfg, self.weights, self.ops, self.moe, self.kv, self.states)
        self.forward = self._make_forward()
        self.prefix_cache, self.checkpoints, anchors = build.prefix_cache_for(
            cfg, self.config, self.ops, self.tokenizer, self._device_spare)
        self.scheduler = Scheduler(self.kv, config.max_running_requests, config.chunked_prefill_size,
                                   self.max_model_len, self.prefix_cache, self.states, anchors)
        self._streams: dict[str, TextStream] = {}
        self._seeds = np.random.default_rng(config.seed)
        self.eos_ids = frozenset(self.tokenizer.stop_token_ids)
        self.warmup()                       # no tuner yet: the warm-up's steps are compiles
        self._tuner = self._make_tuner()
        if self._grammars is not None:      # built before serving: the build holds the GIL
            self._grammars.join()

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
        if self.ops.name != "cpu" or self.config.disable_thread_tuning:
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
        kind = "hybrid" if self.model_config.has_gdn else "moe"
        dtype = "bf16" if self.weights.embed.dtype == np.uint16 else "f32"
        return watch_compiles(logger, f"{kind}/{dtype}")

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

    def _plan_gpu_memory(self) -> None:
        """On CUDA, split the GPU budget (free memory or --gpu-memory-gb) into weights, KV, expert
        cache and workspace; sizes the user did not give come from the plan (one log line)."""
        self._device_spare = 0                      # the plan's bytes for a hybrid's device checkpoints
        if self.ops.name != "cuda":
            return
        cupy = load_cupy()
        from freetoken.engine.gpu_budget import plan_gpu_memory
        plan = plan_gpu_memory(self.model_config, self.config, cupy.cuda.runtime.memGetInfo()[0])
        logger.info("GPU memory plan: %s (%s)", plan.describe(), plan.capped_by)
        self._device_spare = plan.checkpoint_bytes
        changes = {}
        if self.config.num_kv_tokens <= 0:
            changes["num_kv_tokens"] = plan.kv_tokens
        if self.config.moe_cache_size <= 0 and self.config.moe_cache_rate <= 0:
            changes["moe_cache_size"] = min(plan.expert_slots, plan.total_experts)
            if plan.expert_slots == 0 and self.config.moe_backend not in ("cpu", "fused"):
                # 0 would read as "not given" (the 25% default, which does not fit); one slot
                # runs: hybrid sends whatever does not fit to the CPU
                logger.info("GPU memory plan leaves no room for expert slots; using 1")
                changes["moe_cache_size"] = 1
        self.config = self.config.replace(**changes)

    def _make_kv_pool(self):
        from freetoken.engine.build import make_kv_pool
        return make_kv_pool(self.model_config, self.config, self.weights, self.max_model_len, self.ops.xp)

    def _make_moe(self):
        """The MoE runtime over this backend's device; auto is resolved from the bandwidth profile
        on a GPU, by build_moe on the host (cpu)."""
        from freetoken.moe.device import device_for
        from freetoken.moe.runtime import build_moe
        cfg = self.model_config
        banks = [(self.weights.layers[i].gate_up, self.weights.layers[i].down) for i in cfg.moe_layers]
        dev = device_for(self.ops.name)
        backend, phi = (None, None) if dev.host_memory else self._gpu_moe_choice(banks)
        moe = build_moe(cfg, getattr(self, "host_pool", None) or banks, self.config, self.ops.experts,
                        logger, dev=dev, backend=backend, profile_phi=phi)
        self.host_pool = moe.host          # pinned once; rebuilds and new runtimes reuse it
        return moe

    def _gpu_moe_choice(self, banks):
        """--moe-backend with auto resolved from the bandwidth profile (one log line), and phi."""
        cupy = load_cupy()
        from freetoken.moe.device import gpu_identity
        from freetoken.moe.profile import decide_backend, load_profile, phi
        fmt = "bf16" if banks[0][0].dtype == np.uint16 else "f32"
        profile = load_profile((gpu_identity() or ("unknown", ""))[0], fmt, log=logger)
        expert_bytes = sum(gu.nbytes + dn.nbytes for gu, dn in banks)
        fits = expert_bytes <= 0.9 * cupy.cuda.runtime.memGetInfo()[0]   # KV pool already allocated
        backend = decide_backend(self.config.moe_backend, logger, gpu=True, fits=fits, profile=profile)
        return backend, phi(profile)

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
        """Resize the expert cache and/or KV pool while idle (engine/rebuild.py)."""
        from freetoken.engine.rebuild import rebuild_cache
        return rebuild_cache(self, moe_cache_size, num_kv_tokens)

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
        self._streams[req.rid] = TextStream(self.tokenizer.detokenizer(), params.stop)
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
        captured graphs (fused MoE only: the other backends wait on the host each layer)."""
        if self.ops.name != "cuda":
            return self.model.forward
        from freetoken.engine.graphs import DecodeGraphs
        fused = self.moe.stats().get("backend") == "fused"
        hybrid = self.model_config.has_gdn        # graphs do not capture the state-pool rows yet
        enabled = fused and not self.config.disable_cuda_graph and not hybrid
        graphs = DecodeGraphs(self.model, self.ops, self.config.max_running_requests,
                              self.max_model_len, enabled=enabled)
        if not enabled:
            logger.info("cuda graphs off (%s)", "a hybrid (Gated DeltaNet) model" if hybrid else
                        "--disable-cuda-graph" if fused else "the MoE backend is not fused")
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
