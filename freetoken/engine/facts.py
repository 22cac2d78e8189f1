"""What start-up measures for the plan (engine/plan.py): whether a GPU is visible and how much of
its memory is free, the loaded weights' format, the bandwidth profile, the host memory available.
The only I/O of planning; make_plan itself reads nothing but these facts.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from freetoken.engine.plan import DeviceFacts
from freetoken.log import logger


def probe_gpu(config) -> DeviceFacts:
    """Whether a CUDA device is visible, probed only when --backend may use one (auto or cuda):
    importing CuPy costs time and must not happen for --backend cpu."""
    if config.backend not in ("auto", "cuda"):
        return DeviceFacts(gpu_missing=f"--backend {config.backend}")
    from freetoken.backend import cuda_unavailable_reason, visible_device
    missing = cuda_unavailable_reason()
    return DeviceFacts(gpu_missing=missing, gpu_name="" if missing else visible_device())


def after_loading(facts: DeviceFacts, weights, moe_layers: tuple) -> DeviceFacts:
    """The facts the plan needs once the weights are in host memory: their format (and, quantized,
    their bytes as stored), the host memory left, and on a GPU (the compute backend whenever one
    was probed and found) its free memory and this GPU's bandwidth profile for the experts' format."""
    from freetoken.env import available_memory_bytes
    from freetoken.kernels.qformats import is_quantized
    dense = weights.final_norm if is_quantized(weights.embed) else weights.embed   # norms are never blocks
    fmt = "bf16" if dense.dtype == np.uint16 else "f32"
    facts = replace(facts, weights_dtype=fmt, host_available_bytes=available_memory_bytes(),
                    stored_bytes=stored_bytes(weights, moe_layers))
    if facts.gpu_missing is not None:
        return facts
    from freetoken.cupy_loader import cupy as load_cupy
    from freetoken.moe.device import gpu_identity
    from freetoken.moe.profile import load_profile
    cupy = load_cupy()
    profile = (load_profile((gpu_identity() or ("unknown", ""))[0], expert_format(weights, moe_layers), log=logger)
               if moe_layers else None)
    return replace(facts, free_device_bytes=int(cupy.cuda.runtime.memGetInfo()[0]), profile=profile)


def expert_format(weights, moe_layers: tuple) -> str:
    """The routed experts' format, which the bandwidth profile is keyed by: the first MoE layer's
    gate_up, a quantized format's name ("q4_k", "fp8_b128") or "bf16" / "f32"."""
    from freetoken.kernels.qformats import format_of, is_quantized
    gate_up = weights.layers[moe_layers[0]].gate_up
    if is_quantized(gate_up):
        return format_of(gate_up).name
    return "bf16" if gate_up.dtype == np.uint16 else "f32"


def stored_bytes(weights, moe_layers: tuple) -> tuple[int, int] | None:
    """(non-expert weight bytes, one expert slot's bytes: the largest layer's) as loaded, when any
    weight is quantized (its blocks are what the GPU holds); None for dense weights, whose bytes the
    plan counts from the config."""
    from freetoken.engine.build import device_fields
    from freetoken.kernels.qformats import is_quantized
    from freetoken.moe.pool import Bank, quantized_slot_bytes
    dense = [weights.embed, weights.final_norm] + ([] if weights.lm_head is weights.embed else [weights.lm_head])
    dense += [getattr(lw, name) for lw in weights.layers for name in device_fields(lw)]
    arrays = [p for a in dense for p in (a if isinstance(a, tuple) else (a,))]
    banks = [Bank(weights.layers[i].gate_up, weights.layers[i].down) for i in moe_layers]
    if not any(is_quantized(a) for a in arrays) and not any(b.quantized for b in banks):
        return None
    if banks and banks[0].quantized:
        slot = sum(quantized_slot_bytes(banks))                      # what moe/pool.slot_pool allocates
    else:
        slot = max((sum(b.expert_bytes) for b in banks), default=0)
    return sum(int(a.nbytes) for a in arrays), slot
