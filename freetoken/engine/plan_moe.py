"""The plan's MoE decisions: which backend runs the routed experts, how many expert-cache slots, and
which misses a layer-step fetches (docs/moe.md, docs/design.md). Pure: every input is a number, a
flag or a measured fact; each decision comes back with the sentence that explains it.

Shape legend: Lm MoE layers, E experts, k routed, S slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from freetoken.config import ConfigError, ModelConfig
from freetoken.moe.runtime import BACKENDS, CACHED, MoEPlan
from freetoken.moe.split import FetchPolicy

DEFAULT_CACHE_RATE = 0.25     # of all Lm*E experts, when no size flag is given and no GPU plan sizes it
FALLBACK_CAP = 1              # hybrid without --moe-fetch-fraction or a bandwidth profile


@dataclass(frozen=True)
class Decision:
    """One thing the plan settled: what, its value, and the sentence that says why."""

    name: str
    value: str
    why: str
    warn: bool = False        # a fallback the user should see (logged as a warning too)


@dataclass(frozen=True)
class MoEAsk:
    """What the flags ask of the MoE runtime."""

    backend: str                  # "auto" or one of BACKENDS
    cache_size: int | None
    cache_rate: float | None


def step_need(num_experts: int, top_k: int, max_running: int) -> int:
    """Most distinct experts one decode layer-step can route: max_running * k, capped at E."""
    return min(max(1, max_running) * top_k, num_experts)


def rate_slots(rate: float, total: int) -> int:
    """--moe-cache-rate as slots: ceil(rate * Lm*E); round first, so 0.1 * 100 gives 10, not 11."""
    return math.ceil(round(rate * total, 9))


def plan_moe(cfg: ModelConfig, ec, ask: MoEAsk, gpu: bool, fit: int | None, profile,
             host_pinned: bool = True) -> tuple[MoEPlan, list[Decision]]:
    """The MoE runtime's plan. gpu: the compute device is a GPU (experts in host memory are
    fetched over PCIe); fit: expert slots the GPU memory plan has room for (None on the host: no
    limit); profile: the bandwidth profile (moe/profile.py) or None; host_pinned: False once
    pinning the host expert pool failed (start-up plans again with it)."""
    total = len(cfg.moe_layers) * cfg.num_experts
    need = step_need(cfg.num_experts, cfg.num_experts_per_tok, ec.max_running_requests)
    backend = _backend(ask.backend, gpu, total, fit, profile)
    slots, fell_back = _slots(backend.value, ask, total, need, fit, cfg)
    decisions = [backend, slots]
    chosen = fell_back.value if fell_back else backend.value
    if fell_back:
        decisions.append(fell_back)
    if chosen in CACHED and gpu and not host_pinned:
        decisions.append(Decision("moe backend", "cpu", f"--moe-backend {chosen} needs a pinned host expert pool "
                                  "and pinning it failed: every routed expert runs on the CPU", warn=True))
        chosen = "cpu"
    count = int(slots.value) if chosen in CACHED else 0
    policy = _policy(chosen, ec, cfg.num_experts, profile, fell_back is not None)
    if policy is not None:
        decisions.append(policy[1])
    return MoEPlan(chosen, count, policy[0] if policy else None, ec.moe_cpu_threads,
                   not ec.moe_prefill_overlap, ec.moe_prefill_decode_tokens), decisions


def _backend(asked: str, gpu: bool, total: int, fit: int | None, profile) -> Decision:
    if asked in BACKENDS:
        return Decision("moe backend", asked, "--moe-backend")
    if asked != "auto":
        raise ConfigError(f"--moe-backend {asked!r}; expected auto or one of {', '.join(BACKENDS)}")
    if not gpu:
        return Decision("moe backend", "cpu", "auto: no GPU, so every routed expert runs on the CPU from the host pool")
    if fit is None or fit >= total:
        return Decision("moe backend", "fused", f"auto: every expert fits in GPU memory ({total} experts)")
    from freetoken.moe.profile import recommend
    choice, reason = recommend(profile, fits=False)
    return Decision("moe backend", choice, f"auto: {reason}")


def _slots(backend: str, ask: MoEAsk, total: int, need: int, fit: int | None, cfg) -> tuple[Decision, Decision | None]:
    """(the expert-cache decision, the offload -> hybrid fallback or None)."""
    if backend == "cpu":
        return Decision("expert cache", "0", "every routed expert runs on the CPU: no expert cache"), None
    if backend == "fused":
        if fit is not None and fit < total:
            raise ConfigError(f"--moe-backend fused needs all {total} experts on the GPU; the memory plan has room "
                              f"for {fit} (use offload or hybrid, or free GPU memory)")
        return Decision("expert cache", str(total), "fused: every expert resident"), None
    slots, why = _asked_slots(ask, total, need, fit)
    if slots > total:
        slots, why = total, f"{why}; {slots} asked, {total} (= Lm*E) are enough"
    decision = Decision("expert cache", str(slots), why)
    if backend == "offload" and slots < need:
        return decision, _offload_too_small(slots, need, cfg)
    return decision, None


def _asked_slots(ask: MoEAsk, total: int, need: int, fit: int | None) -> tuple[int, str]:
    if ask.cache_size is not None or ask.cache_rate is not None:
        flag = "--moe-cache-size" if ask.cache_size is not None else "--moe-cache-rate"
        slots, why = ((ask.cache_size, flag) if ask.cache_size is not None else
                      (rate_slots(ask.cache_rate, total), f"{flag} {ask.cache_rate:g} of {total} experts"))
        if fit is not None and min(slots, total) > fit:
            raise ConfigError(f"{flag}: an expert cache of {min(slots, total)} slots does not fit: the "
                              f"GPU memory plan has room for {fit} after weights, workspace and KV")
        return slots, why
    if fit is None:
        slots = max(math.ceil(DEFAULT_CACHE_RATE * total), need)
        return slots, f"default: {DEFAULT_CACHE_RATE:.0%} of {total} experts, at least one decode step's {need}"
    if fit == 0:   # one slot runs: hybrid sends whatever does not fit to the CPU
        return 1, "the GPU memory plan leaves no room for expert slots; one slot"
    return fit, "all the GPU memory the plan leaves after weights, workspace and KV"


def offload_too_small(slots: int, need: int, top_k: int) -> str:
    """Why offload cannot run on this cache: it fetches every miss."""
    return (f"an expert cache of {slots} slots cannot fetch every miss of a decode step that routes up to "
            f"{need} distinct experts (max_running_requests x top-{top_k})")


def _offload_too_small(slots: int, need: int, cfg) -> Decision:
    """Offload below one decode step's need: GPU memory should change speed, never whether a model
    runs, so at start-up that becomes hybrid with a fixed cap of E fetches (every miss that finds an
    evictable slot is fetched, the rest run on the CPU)."""
    why = offload_too_small(slots, need, cfg.num_experts_per_tok)
    return Decision("moe backend", "hybrid", f"offload falls back to hybrid: {why}; misses are fetched while "
                    f"evictable slots last, the rest run on the CPU (give --moe-cache-size >= {need} for offload)",
                    warn=True)


def _policy(backend: str, ec, num_experts: int, profile, fell_back: bool):
    """(FetchPolicy, its Decision) of a cached backend, else None."""
    fill, order = ec.moe_min_fill, ec.moe_fill_order
    if backend == "offload":
        return FetchPolicy.fetch_all(order), Decision("fetch policy", "fetch every miss", "offload")
    if backend != "hybrid":
        return None
    warn, from_profile = False, _phi(profile)
    if fell_back:
        policy, why = FetchPolicy.fixed_cap(num_experts, order=order), "offload's fallback: every miss that fits"
    elif ec.moe_hybrid_max_fetch is not None:
        policy, why = FetchPolicy.fixed_cap(ec.moe_hybrid_max_fetch, fill, order), "--moe-hybrid-max-fetch"
    elif ec.moe_fetch_fraction is not None:
        policy, why = FetchPolicy.fraction(ec.moe_fetch_fraction, fill, order), "--moe-fetch-fraction"
    elif from_profile is not None:
        policy, why = FetchPolicy.fraction(from_profile, fill, order), "phi from the bandwidth profile"
    else:
        policy, warn = FetchPolicy.fixed_cap(FALLBACK_CAP, fill, order), True
        why = (f"hybrid: no bandwidth profile and no --moe-fetch-fraction: a fixed cap of {FALLBACK_CAP} fetch "
               "per layer-step (run `python -m freetoken bench bw`)")
    return policy, Decision("fetch policy", policy.describe(), why, warn)


def _phi(profile):
    from freetoken.moe.profile import phi
    return phi(profile)
