"""The start-up plan: every size and backend the engine uses, settled once from the model's shape,
the flags as the user gave them (EngineConfig, never rewritten) and the facts start-up measured
(DeviceFacts). Pure: no I/O, no device; tests plan GPUs on a CPU with made-up facts.

make_plan settles, in order: the compute backend, the context length, the KV dtype, the GPU memory
split (plan_memory.py), the KV pool, the MoE backend, expert slots and fetch policy (plan_moe.py),
CUDA graphs, the prefix cache and a GDN model's state checkpoints. Each decision carries the
sentence that explains it; start-up logs the plan as one summary and /v1/cache/status returns it.
An elastic resize is the previous plan with new sizes (plan_resize.py), then EngineCore.rebuild(plan).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.config import ConfigError, EngineConfig, ModelConfig
from freetoken.engine.plan_checks import check_config
from freetoken.engine.plan_memory import (GB, GpuMemory, checkpoint_bytes, host_kv_tokens, kv_bytes_per_token,
                                         split_gpu_memory)
from freetoken.engine.plan_moe import Decision, MoEAsk, plan_moe
from freetoken.moe.runtime import CACHED, MoEPlan, prefill_stream_slots

CHECKPOINTS_PER_REQUEST = 32   # default host budget per running request (bench/agent_edits.py --budgets)
HOST_SHARE = 0.125             # the default takes at most this share of the host memory available


@dataclass(frozen=True)
class DeviceFacts:
    """What start-up measured (engine/facts.py); the plan's only window on the machine."""

    gpu_missing: str | None = "no GPU was probed"   # None: a CUDA device is visible; else why not
    gpu_name: str = ""                    # the visible device, in words
    free_device_bytes: int = 0            # free GPU memory before FreeToken allocated any
    host_available_bytes: int | None = None   # host memory available once the weights are loaded
    weights_dtype: str = "bf16"           # "bf16" | "f32": the loaded weights' (and experts') format
    # (non-expert weights, one expert slot) in bytes as loaded, when not the dtype's size times the
    # parameter count: quantized weights stay in their blocks (engine/facts.py)
    stored_bytes: tuple[int, int] | None = None
    profile: object = None                # moe/profile.Profile of this GPU and format, or None
    host_pinned: bool = True              # False once pinning the host expert pool failed


@dataclass(frozen=True)
class Plan:
    compute: str                  # "ref" | "cpu" | "cuda"
    context_len: int
    kv_tokens: int
    kv_dtype: str                 # "bfloat16" | "float32"
    moe: MoEPlan
    cuda_graphs: bool
    prefix_cache: bool
    checkpoint_host_bytes: int    # state checkpoints (GDN states, sliding windows) in host memory
    checkpoint_device_bytes: int  # ... and on the GPU
    state_rows: int               # per-request state rows (GDN states, sliding windows), one per running request
    memory: GpuMemory | None      # the GPU memory split (cuda only)
    decisions: tuple[Decision, ...]

    @property
    def warnings(self) -> list[str]:
        return [d.why for d in self.decisions if d.warn]     # each why is written to stand alone

    def summary(self) -> str:
        """The plan in a few lines, one per decision, for the start-up log."""
        width = max(len(d.name) for d in self.decisions)
        return "start-up plan:\n" + "\n".join(f"  {d.name:<{width}}  {d.value}  ({d.why})" for d in self.decisions)

    def as_dict(self) -> dict:
        """JSON for /v1/cache/status: the values and, per decision, why."""
        return {"compute": self.compute, "context_len": self.context_len, "kv_tokens": self.kv_tokens,
                "kv_dtype": self.kv_dtype, "moe_backend": self.moe.backend, "expert_slots": self.moe.slots,
                "fetch_policy": self.moe.policy.describe() if self.moe.policy else None,
                "cuda_graphs": self.cuda_graphs, "prefix_cache": self.prefix_cache,
                "checkpoint_host_bytes": self.checkpoint_host_bytes,
                "checkpoint_device_bytes": self.checkpoint_device_bytes,
                "decisions": [{"name": d.name, "value": d.value, "why": d.why, "warn": d.warn}
                              for d in self.decisions]}


def make_plan(model: ModelConfig, config: EngineConfig, facts: DeviceFacts) -> Plan:
    """The plan; raises ConfigError naming the flag that cannot be met."""
    check_config(config)
    compute = compute_backend(config.backend, facts)
    context = _context(model, config)
    kv_dtype = _kv_dtype(config, facts)
    itemsize, weight_size = kv_itemsize(kv_dtype.value), weight_itemsize(facts)
    memory = None
    if compute.value == "cuda":
        memory, kv_why = split_gpu_memory(model, config, facts.free_device_bytes, weight_size, itemsize,
                                          int(context.value), config.num_kv_tokens, facts.stored_bytes)
        kv_tokens = memory.kv_tokens
    else:
        kv_tokens, kv_why = host_kv_tokens(config.num_kv_tokens, config.max_running_requests, int(context.value),
                                           kv_bytes_per_token(model, itemsize))
    kv = Decision("kv pool", f"{kv_tokens} tokens", kv_why)
    ask = MoEAsk(config.moe_backend, config.moe_cache_size, config.moe_cache_rate)
    fit = memory.fit_slots if memory is not None else None
    moe, moe_decisions = plan_moe(model, config, ask, compute.value == "cuda", fit, facts.profile, facts.host_pinned)
    spare = 0 if memory is None else max(memory.expert_room_bytes - slots_on_gpu(memory, moe, model) * memory.one_expert_bytes, 0)
    graphs = _graphs(compute.value, moe.backend, model, config)
    host, device, ckpt = _checkpoints(model, config, facts, compute.value, spare, itemsize)
    prefix = _prefix_cache(model, config, host + device)
    split = [memory_decision(memory, slots_on_gpu(memory, moe, model))] if memory is not None else []
    decisions = (compute, context, kv_dtype, kv, *moe_decisions, *split, _threads(config), graphs, *ckpt, prefix)
    return Plan(compute.value, int(context.value), kv_tokens, kv_dtype.value, moe, graphs.value == "on",
                prefix.value == "on", host, device, config.max_running_requests if model.keeps_request_state else 0,
                memory, decisions)


def compute_backend(asked: str, facts: DeviceFacts) -> Decision:
    """--backend: auto is cuda when a GPU is visible, else cpu; cuda without one is an error."""
    if asked == "auto":
        if facts.gpu_missing:
            return Decision("compute", "cpu", f"auto: no GPU: {facts.gpu_missing}")
        return Decision("compute", "cuda", f"auto: {facts.gpu_name or 'a CUDA device is visible'}")
    if asked == "cuda" and facts.gpu_missing:
        raise ConfigError(f"--backend cuda: {facts.gpu_missing}")
    return Decision("compute", asked, "--backend")


def _context(model: ModelConfig, config: EngineConfig) -> Decision:
    """--max-model-len as given, even beyond max_position_embeddings (RoPE angles come from the
    positions; nothing is sized by the trained length), with a warning; else the trained length."""
    trained = model.max_position_embeddings
    if config.max_model_len is None:
        return Decision("context", str(trained), "the model's max_position_embeddings")
    if config.max_model_len > trained:
        return Decision("context", str(config.max_model_len), f"--max-model-len {config.max_model_len} is beyond "
                        f"the {trained} positions the model was trained on (max_position_embeddings): it runs, "
                        f"but output quality past {trained} tokens is not guaranteed", warn=True)
    return Decision("context", str(config.max_model_len), "--max-model-len")


def _kv_dtype(config: EngineConfig, facts: DeviceFacts) -> Decision:
    if config.kv_dtype != "auto":
        return Decision("kv dtype", config.kv_dtype, "--kv-dtype")
    if facts.stored_bytes is not None:      # blocks: only their norms were stored f32 (GGUF's rule)
        return Decision("kv dtype", "bfloat16", "auto: the weights are quantized")
    kind = "float32" if facts.weights_dtype == "f32" else "bfloat16"
    return Decision("kv dtype", kind, f"auto: the weights are {facts.weights_dtype}")


def kv_itemsize(kv_dtype: str) -> int:
    return np.dtype(kv_array_dtype(kv_dtype)).itemsize


def kv_array_dtype(kv_dtype: str):
    """The dtype KV arrays are stored in: fp32, or bf16 as its bits (uint16)."""
    return np.float32 if kv_dtype == "float32" else np.uint16


def weight_itemsize(facts: DeviceFacts) -> int:
    """Bytes per stored weight in memory: bf16 stays 2; everything else is widened to fp32."""
    return 2 if facts.weights_dtype == "bf16" else 4


def slots_on_gpu(memory: GpuMemory, moe: MoEPlan, model: ModelConfig) -> int:
    """Expert slots the MoE runtime holds on the GPU: every expert (fused), the cache (offload,
    hybrid), or the slots the cpu backend borrows to stream prefill."""
    if moe.backend == "fused":
        return memory.total_experts
    if moe.backend in CACHED:
        return moe.slots
    return prefill_stream_slots(model.num_experts, moe.disable_prefill_overlap)


def _graphs(compute: str, moe_backend: str, model: ModelConfig, config: EngineConfig) -> Decision:
    """Decode replays captured CUDA graphs with the fused MoE only: the other backends wait on the
    host each layer; a GDN model's state-pool rows are not captured yet."""
    if compute != "cuda":
        return Decision("cuda graphs", "off", "not a CUDA engine")
    reason = ("--no-cuda-graph" if not config.cuda_graph else
              "a GDN (Gated DeltaNet) model" if model.has_gdn else
              f"the MoE backend is {moe_backend}, not fused" if moe_backend != "fused" else None)
    return Decision("cuda graphs", "off" if reason else "on", reason or "fused MoE, decode steps replayed")


def _threads(config: EngineConfig) -> Decision:
    if config.moe_cpu_threads is None:
        return Decision("moe cpu threads", "auto", "numba's thread count")
    return Decision("moe cpu threads", str(config.moe_cpu_threads), "--moe-cpu-threads")


def _checkpoints(model: ModelConfig, config: EngineConfig, facts: DeviceFacts, compute: str,
                 device_spare: int, kv_itemsize: int) -> tuple[int, int, list[Decision]]:
    """(host bytes, device bytes, decisions) of the state checkpoints of a model whose requests
    keep state (GDN states, sliding windows: plan_memory.checkpoint_bytes). Host:
    --state-checkpoint-mb, else CHECKPOINTS_PER_REQUEST per running request, at most HOST_SHARE of
    the memory available now. Device: --state-checkpoint-gpu-mb (the memory split claimed it), else
    what the expert cache leaves, at most the host tier's size."""
    if not model.keeps_request_state or not config.enable_prefix_cache:
        return 0, 0, []
    row, running, avail = checkpoint_bytes(model, kv_itemsize), config.max_running_requests, facts.host_available_bytes
    if config.state_checkpoint_mb is not None:
        host, why = config.state_checkpoint_mb << 20, "--state-checkpoint-mb"
    else:
        want = CHECKPOINTS_PER_REQUEST * running * row
        host = max(min(want, int(HOST_SHARE * avail)), row) if avail else want
        why = f"auto: {CHECKPOINTS_PER_REQUEST} per running request x {running}" + (
            f", at most 1/{round(1 / HOST_SHARE)} of {avail / 2**30:.1f} GiB available" if host < want else "")
    decisions = [Decision("checkpoints (host)", f"{_mib(host)} = {host // row} of {_mib(row)}", why)]
    if compute != "cuda":
        return host, 0, decisions
    if config.state_checkpoint_gpu_mb is not None:
        device, why = config.state_checkpoint_gpu_mb << 20, "--state-checkpoint-gpu-mb"
    else:
        device, why = min(device_spare, host), "auto: GPU memory the expert cache leaves, at most the host tier"
    decisions.append(Decision("checkpoints (device)", f"{_mib(device)} = {device // row}", why))
    return host, device, decisions


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _prefix_cache(model: ModelConfig, config: EngineConfig, checkpoint_budget: int) -> Decision:
    if not config.enable_prefix_cache:
        return Decision("prefix cache", "off", "--no-enable-prefix-cache")
    kind = "a GDN model" if model.has_gdn else "a sliding-window model"
    if model.keeps_request_state and checkpoint_budget <= 0:
        return Decision("prefix cache", "off", f"{kind} reuses a cached prefix only with a state checkpoint, "
                        "and --state-checkpoint-mb is 0")
    return Decision("prefix cache", "on", "radix tree over token ids" + (
        ", resumed at state checkpoints" if model.keeps_request_state else ""))


def memory_decision(memory: GpuMemory, slots: int) -> Decision:
    return Decision("gpu memory", describe_memory(memory, slots), f"the budget is {memory.capped_by}")


def describe_memory(memory: GpuMemory, slots: int) -> str:
    """The GPU memory split in one line (the summary's 'gpu memory' decision)."""
    gb = lambda n: f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"
    return (f"budget {gb(memory.budget_bytes)}: weights {gb(memory.weights_bytes)}, "
            f"workspace {gb(memory.workspace_bytes)}, KV {gb(memory.kv_bytes)}, expert cache "
            f"{gb(slots * memory.one_expert_bytes)} ({slots} of {memory.total_experts} experts)"
            + (f", state checkpoints {gb(memory.checkpoint_claim_bytes)}" if memory.checkpoint_claim_bytes else "")
            + (f", per-request states {gb(memory.state_bytes)}" if memory.state_bytes else ""))
