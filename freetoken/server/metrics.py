"""Server counters and the Prometheus text exposition of them plus the engine's snapshot."""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter

PREFIX = "freetoken_"
# seconds; wide at the top, since a long prompt on an offloaded MoE can take minutes
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Histogram:
    """A Prometheus histogram: cumulative buckets (le = upper bound), their sum and count."""

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)    # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def samples(self) -> list:
        out, total = [], 0
        for bound, n in zip((*self.bounds, "+Inf"), self.counts):
            total += n
            out.append(({"le": str(bound)}, total, "_bucket"))
        return out + [({}, round(self.sum, 6), "_sum"), ({}, self.count, "_count")]


class Metrics:
    """Counters updated on the event loop (single-threaded, no locks needed)."""

    def __init__(self):
        self.http = Counter()            # (route, status) -> responses
        self.finished = Counter()        # (route, finish_reason) -> generation requests
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0           # prompt tokens served from the prefix cache
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.duration = Histogram(REQUEST_BUCKETS)
        self.active = 0                  # generation requests currently open

    def observe_http(self, route: str, status: int) -> None:
        self.http[(route, status)] += 1

    def observe_generation(self, route: str, finish: str, prompt: int, completion: int, cached: int,
                           ttft: float | None, seconds: float) -> None:
        self.finished[(route, finish)] += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.cached_tokens += cached
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion > 1 and seconds > ttft:
                # each of the request's gaps counts once, at the request's mean gap
                self.itl.observe((seconds - ttft) / (completion - 1), completion - 1)
        self.duration.observe(seconds)

    def render(self, engine_state: str, engine: dict | None, counters: dict, decode_tok_s: float,
               model: str = "") -> str:
        out: list[str] = []
        metric = _writer(out)
        metric("http_requests_total", "counter", "HTTP responses by route and status",
               [({"route": r, "status": str(s)}, n) for (r, s), n in sorted(self.http.items())])
        metric("requests_total", "counter", "finished generation requests by route and finish reason",
               [({"route": r, "finish_reason": f}, n) for (r, f), n in sorted(self.finished.items())])
        metric("requests_active", "gauge", "generation requests open now", [({}, self.active)])
        metric("prompt_tokens_total", "counter", "prompt tokens of finished requests", [({}, self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "generated tokens", [({}, self.completion_tokens)])
        metric("prefix_cache_hit_tokens_total", "counter", "prompt tokens reused from the prefix cache",
               [({}, self.cached_tokens)])
        metric("time_to_first_token_seconds", "histogram", "generation start to first token",
               self.ttft.samples())
        metric("inter_token_latency_seconds", "histogram", "time between output tokens (each request's "
               "gaps at its mean gap)", self.itl.samples())
        metric("request_duration_seconds", "histogram", "generation start to last token",
               self.duration.samples())
        metric("engine_ready", "gauge", "1 once the model is loaded", [({}, int(engine_state == "ready"))])
        metric("engine_steps_total", "counter", "engine forward steps", [({}, counters["steps"])])
        metric("engine_step_errors_total", "counter", "engine steps that raised", [({}, counters["step_errors"])])
        metric("decode_tokens_total", "counter", "tokens sampled in decode steps", [({}, counters["decode_tokens"])])
        metric("decode_seconds_total", "counter", "time in decode steps",
               [({}, round(counters["decode_seconds"], 6))])
        metric("prefill_seconds_total", "counter", "time in steps that prefill prompts",
               [({}, round(counters["prefill_seconds"], 6))])
        metric("decode_tokens_per_second", "gauge", "recent decode throughput (all running requests)",
               [({}, round(decode_tok_s, 3))])
        if engine is not None:
            _engine_metrics(metric, engine)
            _gateway_metrics(_writer(out, ""), engine, model)
        return "\n".join(out) + "\n"


def _gateway_metrics(metric, s: dict, model: str) -> None:
    """The queue and KV gauges again under the names gateway schedulers read (llm-d's inference
    scheduler, vLLM's names; ``perc`` is a fraction in [0, 1] there too), labelled by model."""
    label = {"model_name": model}
    metric("vllm:num_requests_waiting", "gauge", "requests waiting for admission", [(label, s["waiting"])])
    metric("vllm:num_requests_running", "gauge", "requests admitted and running", [(label, s["running"])])
    metric("vllm:kv_cache_usage_perc", "gauge", "used KV slots / capacity (a fraction)", [(label, _kv_used(s))])


def _engine_metrics(metric, s: dict) -> None:
    metric("queue_waiting", "gauge", "requests waiting for admission", [({}, s["waiting"])])
    metric("requests_running", "gauge", "requests admitted and running", [({}, s["running"])])
    metric("kv_slots", "gauge", "KV pool capacity in tokens", [({}, s["kv_slots"])])
    metric("kv_slots_free", "gauge", "free KV slots", [({}, s["kv_free"])])
    metric("kv_slots_prefix_cached", "gauge", "KV slots held by the radix prefix cache",
           [({}, s["kv_prefix_cached"])])
    metric("kv_occupancy_ratio", "gauge", "used KV slots / capacity", [({}, _kv_used(s))])
    ck = s.get("checkpoints") or {}
    if ck:
        metric("state_checkpoints", "gauge", "state checkpoints held (GDN and sliding-window models)", [({}, ck["checkpoints"])])
        metric("state_checkpoint_bytes", "gauge", "bytes of state checkpoints by tier",
               [({"tier": name}, tier["bytes"]) for name, tier in ck["tiers"].items()])
        metric("state_checkpoint_budget_bytes", "gauge", "byte budget of state checkpoints by tier",
               [({"tier": name}, tier["budget_bytes"]) for name, tier in ck["tiers"].items()])
        for key in ("taken", "hits", "evicted", "dropped", "demoted", "reused_tokens"):
            metric(f"state_checkpoints_{key}_total", "counter", f"state checkpoints: {key.replace('_', ' ')}",
                   [({}, ck[key])])
    moe = s.get("moe") or {}
    if _number(moe.get("slots")):
        metric("moe_cache_slots", "gauge", "MoE expert cache size in experts", [({}, moe["slots"])])
    for name, value in sorted((moe.get("total") or {}).items()):
        if not _number(value):
            continue
        if name.endswith("rate"):
            metric(f"moe_{name}", "gauge", f"MoE expert cache: {name.replace('_', ' ')}", [({}, value)])
        else:
            metric(f"moe_{name}_total", "counter", f"MoE expert cache: {name.replace('_', ' ')}", [({}, value)])


def _kv_used(s: dict) -> float:
    return round((s["kv_slots"] - s["kv_free"]) / s["kv_slots"], 6) if s["kv_slots"] else 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _writer(out: list[str], prefix: str = PREFIX):
    def metric(name: str, kind: str, help_text: str, samples) -> None:
        full = prefix + name
        out.append(f"# HELP {full} {help_text}")
        out.append(f"# TYPE {full} {kind}")
        for sample in samples:
            labels, value = sample[0], sample[1]
            suffix = sample[2] if len(sample) > 2 else ""
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            out.append(f"{full}{suffix}{'{' + text + '}' if text else ''} {value}")
    return metric


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
