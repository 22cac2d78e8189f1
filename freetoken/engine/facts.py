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
    """The facts the plan needs once the weights are in host memory: their format, the host
    memory left, and on a GPU (the compute backend whenever one was probed and found) its free
    memory and this GPU's bandwidth profile for the format."""
    from freetoken.env import available_memory_bytes
    from freetoken.kernels.qformats import is_quantized
    fmt = "bf16" if weights.embed.dtype == np.uint16 else "f32"
    if facts.gpu_missing is None and any(is_quantized(weights.layers[i].gate_up) for i in moe_layers):
        fmt = "f32"            # the CUDA path widens quantized experts to f32 (moe/runtime.widened_banks)
    facts = replace(facts, weights_dtype=fmt, host_available_bytes=available_memory_bytes())
    if facts.gpu_missing is not None:
        return facts
    from freetoken.cupy_loader import cupy as load_cupy
    from freetoken.moe.device import gpu_identity
    from freetoken.moe.profile import load_profile
    cupy = load_cupy()
    profile = load_profile((gpu_identity() or ("unknown", ""))[0], fmt, log=logger) if moe_layers else None
    return replace(facts, free_device_bytes=int(cupy.cuda.runtime.memGetInfo()[0]), profile=profile)
