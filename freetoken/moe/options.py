"""Start-up decisions of the MoE runtime, from EngineConfig: backend, cache size, fetch policy.

Pure policy: every input is a number or a flag, nothing here touches a device. Every automatic
decision and every fallback is one log line that says why (DESIGN §5.2).

Shape legend: L MoE layers, E experts, k routed, S slots.
"""
from __future__ import annotations

import logging
import math

from freetoken.config import ConfigError, EngineConfig
from freetoken.moe.split import FetchPolicy

BACKENDS = ("fused", "offload", "cpu", "hybrid")
DEFAULT_CACHE_RATE = 0.25           # of all L*E experts, when no size flag is given
FALLBACK_CAP = 1                    # hybrid without --moe-fetch-fraction or a profile (upstream)


class Log:
    """Adapts a logging.Logger (info/warning) or a plain callable(msg) to info()/warn()."""

    def __init__(self, sink=None):
        if isinstance(sink, Log):
            sink = sink._sink
        self._sink = sink if sink is not None else logging.getLogger("freetoken.moe")

    def info(self, msg: str) -> None:
        if hasattr(self._sink, "info"):
            self._sink.info(msg)
        else:
            self._sink(msg)

    def warn(self, msg: str) -> None:
        if hasattr(self._sink, "warning"):
            self._sink.warning(msg)
        else:
            self._sink(f"WARN {msg}")


def choose_backend(requested: str, log: Log, *, gpu: bool = False, fits: bool = False,
                   recommended: str | None = None) -> str:
    """--moe-backend -> one of BACKENDS. auto: cpu without a GPU; else fused if every expert fits,
    hybrid if the bandwidth profile recommends it, else offload."""
    if requested in BACKENDS:
        return requested
    if requested != "auto":
        raise ConfigError(f"--moe-backend {requested!r}; expected auto or one of {', '.join(BACKENDS)}")
    if not gpu:
        choice, why = "cpu", "no GPU, so every routed expert runs on the CPU from the host pool"
    elif fits:
        choice, why = "fused", "every expert fits in GPU memory"
    elif recommended == "hybrid":
        choice, why = "hybrid", "the bandwidth profile recommends it"
    else:
        choice, why = "offload", "the experts do not fit and no bandwidth profile recommends hybrid"
    log.info(f"moe-backend auto -> {choice}: {why}")
    return choice


def step_need(num_experts: int, top_k: int, max_running: int) -> int:
    """Most distinct experts one decode layer-step can route: max_running * k, capped at E."""
    return min(max(1, max_running) * top_k, num_experts)


def rate_slots(rate: float, total: int) -> int:
    """--moe-cache-rate as slots: ceil(rate * L*E); round first, so 0.1 * 100 gives 10, not 11."""
    return math.ceil(round(rate * total, 9))


def cache_slots(num_layers: int, num_experts: int, top_k: int, ec: EngineConfig, log: Log,
                backend: str | None = None) -> int:
    """S from --moe-cache-size or --moe-cache-rate (ceil of rate * L*E); default 25%, >= one step.

    backend (default ec.moe_backend): hybrid runs at any S >= 1 (a step fetches at most its
    evictable slots, the rest runs on the CPU). Any other backend -- offload, or one not resolved
    yet -- fetches every miss, so a cache below one decode step's need is an error here; at start-up
    cache_plan turns that case into hybrid instead."""
    size, rate, total = ec.moe_cache_size, ec.moe_cache_rate, num_layers * num_experts
    need = step_need(num_experts, top_k, ec.max_running_requests)
    if size > 0 and rate > 0:
        raise ConfigError(f"--moe-cache-size ({size}) and --moe-cache-rate ({rate}) are mutually "
                          "exclusive; give one of them")
    if size < 0 or not 0 <= rate <= 1:
        raise ConfigError(f"--moe-cache-size must be >= 0 and --moe-cache-rate in [0, 1]; "
                          f"got {size} and {rate}")
    if size > 0:
        slots = size
    elif rate > 0:
        slots = rate_slots(rate, total)
    else:
        slots = max(math.ceil(DEFAULT_CACHE_RATE * total), need)
        log.info(f"expert cache: {slots} slots by default ({DEFAULT_CACHE_RATE:.0%} of {total} "
                 f"experts, at least one step's {need})")
    if slots < need and (backend or ec.moe_backend) != "hybrid":
        raise ConfigError(
            f"expert cache of {slots} slots is too small: one decode step can route {need} distinct "
            f"experts in a layer (max_running_requests {ec.max_running_requests} x top-{top_k}, "
            f"capped at E={num_experts}) and offload fetches every miss; give --moe-cache-size >= "
            f"{need} or --moe-backend hybrid, which runs at any cache size")
    if slots > total:
        log.info(f"expert cache: {slots} slots asked, {total} (= L*E) are enough; using {total}")
        slots = total
    return slots


def hybrid_policy(ec: EngineConfig, log: Log, profile_phi: float | None = None) -> FetchPolicy:
    """--moe-hybrid-max-fetch N >= 0: fixed cap; else --moe-fetch-fraction >= 0; else the
    profile's phi; else WARN and a fixed cap of 1 (upstream's fallback)."""
    fill, order = ec.moe_min_fill, ec.moe_fill_order
    if ec.moe_hybrid_max_fetch >= 0:
        policy = FetchPolicy.fixed_cap(ec.moe_hybrid_max_fetch, fill, order)
    elif ec.moe_fetch_fraction >= 0:
        policy = FetchPolicy.fraction(ec.moe_fetch_fraction, fill, order)
    elif profile_phi is not None:
        policy = FetchPolicy.fraction(profile_phi, fill, order)
    else:
        log.warn(f"hybrid: no bandwidth profile and no --moe-fetch-fraction; falling back to a fixed "
                 f"cap of {FALLBACK_CAP} fetch per layer-step (run `python -m freetoken bench bw`)")
        policy = FetchPolicy.fixed_cap(FALLBACK_CAP, fill, order)
    log.info(f"hybrid: {policy.describe()}")
    return policy


def cache_policy(backend: str, ec: EngineConfig, log: Log, profile_phi: float | None) -> FetchPolicy:
    """The fill policy of a cached backend: fetch every miss (offload) or the hybrid rule."""
    if backend == "offload":
        return FetchPolicy.fetch_all(ec.moe_fill_order)
    return hybrid_policy(ec, log, profile_phi)


def cache_plan(backend: str, num_layers: int, num_experts: int, top_k: int, ec: EngineConfig,
               log: Log, profile_phi: float | None = None) -> tuple[str, int, FetchPolicy]:
    """(backend, S, fill policy) of a cached backend (offload or hybrid).

    Offload fetches every miss, which a cache below one decode step's need cannot do. GPU memory
    should change speed, never whether a model runs, so that case becomes hybrid (WARN) with a
    fixed cap of E fetches, i.e. every miss that finds an evictable slot is fetched, as offload
    would, and the misses left over run on the CPU. A cap, not FetchPolicy.fetch_all: the runtimes
    start no CPU branch for a fetch-all policy, which never leaves a miss over at S >= need."""
    slots = cache_slots(num_layers, num_experts, top_k, ec, log, backend="hybrid")
    need = step_need(num_experts, top_k, ec.max_running_requests)
    if backend == "offload" and slots < need:
        log.warn(f"moe offload: an expert cache of {slots} slots cannot fetch every miss of a decode "
                 f"step that routes up to {need} distinct experts (max_running_requests "
                 f"{ec.max_running_requests} x top-{top_k}); falling back to --moe-backend hybrid: "
                 f"misses are fetched while evictable slots last, the rest run on the CPU "
                 f"(give --moe-cache-size >= {need} for offload)")
        return "hybrid", slots, FetchPolicy.fixed_cap(num_experts, order=ec.moe_fill_order)
    return backend, slots, cache_policy(backend, ec, log, profile_phi)


def prefill_as_decode(ids, xp, max_tokens: int, num_slots: int) -> bool:
    """A short prefill chunk (fewer than max_tokens tokens, e.g. after a prefix hit) runs through
    the expert cache like decode when its distinct experts fit the slots; longer chunks touch
    nearly every expert and stream whole layers instead (threshold: docs/performance.md)."""
    if ids.shape[0] >= max_tokens or num_slots <= 0:
        return False
    return int(xp.unique(ids).size) <= num_slots
