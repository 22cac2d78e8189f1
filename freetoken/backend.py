"""The Ops table: the one place a device choice is made.

``get_ops(name)`` returns every op the models call, as plain functions with the signatures in
docs/contracts.md. Models never branch on the device; they call ``ops.<op>``.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable
from freetoken.cupy_loader import cupy as load_cupy, emulated

OP_NAMES = ("embedding", "rms_norm", "rope", "linear", "kv_write", "attention", "router",
            "experts", "sampling", "penalties", "logprobs", "gdn_conv", "gdn_rule", "gated_rms_norm",
            "sigmoid_mul")
BACKENDS = ("ref", "cpu", "cuda")


class BackendError(RuntimeError):
    """A backend that cannot run here; the message says why."""


@dataclass(frozen=True)
class Ops:
    name: str             # "ref" | "cpu" | "cuda"
    xp: ModuleType        # numpy or cupy, for plumbing only (empty, zeros, concatenate)
    embedding: Callable
    rms_norm: Callable
    rope: Callable
    linear: Callable
    kv_write: Callable
    attention: Callable
    router: Callable
    experts: Callable
    sampling: Callable
    penalties: Callable
    logprobs: Callable
    gdn_conv: Callable
    gated_rms_norm: Callable
    sigmoid_mul: Callable
    gdn_rule: Callable
    # the attention half of a Qwen3-MoE decode layer in one call (kernels/decode_layer.py), or None
    # where the model composes the ops (ref, cuda); it returns None for a step it does not take
    decode_layer: Callable | None = None
    # every layer of a one-token Qwen3-MoE decode step in one call (kernels/decode_stack.py), or
    # None; it returns None for a step or a model it does not take
    decode_stack: Callable | None = None

    def to_device(self, a):
        """Host array -> the backend's array type (a no-op for numpy backends)."""
        return self.xp.asarray(a)

    def to_host(self, a):
        return a.get() if hasattr(a, "get") else a


def cuda_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device, else a sentence saying why not."""
    try:
        cupy = load_cupy()
    except ImportError:
        return "CuPy is not installed (pip install 'freetoken[cuda12]' or 'freetoken[cuda13]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "CuPy sees no CUDA device"
    except Exception as e:  # CUDARuntimeError without a driver
        return f"CuPy sees no CUDA device ({type(e).__name__}: {e})"


def visible_device() -> str:
    """Why the cuda backend can run: a real device, or the emulated one (correctness only)."""
    if emulated():
        return "the emulated CUDA device (FREETOKEN_CUDA_EMULATE=1: correctness only, timings are the emulator's)"
    return "a CUDA device is visible"


# Result allocation of each op when the caller passes no `out` (eager CUDA calls). `gpu` wrappers
# never allocate, so that captured graphs see fixed addresses; callers that capture pass `out`.
def _columns(table) -> int:
    """Values per row of a weight (a quantized one's logical width, kernels/qformats.py)."""
    from freetoken.kernels.qformats import logical_shape
    return logical_shape(table)[1]


def _rows(w) -> int:
    """Rows of a weight, or of a tuple of parts stacked along its rows (q/k/v of two formats)."""
    return sum(p.shape[0] for p in w) if isinstance(w, tuple) else w.shape[0]


_RESULTS = {
    "embedding": lambda xp, ids, table, *_: xp.empty((ids.shape[0], _columns(table)), xp.float32),
    "rms_norm": lambda xp, x, *_: xp.empty_like(x),
    "rope": lambda xp, x, *_: xp.empty_like(x),
    "linear": lambda xp, x, w, *_: xp.empty((x.shape[0], _rows(w)), xp.float32),
    "attention": lambda xp, q, *_: xp.empty_like(q),
    "router": lambda xp, logits, k, *_: (xp.empty((logits.shape[0], k), xp.int32),
                                         xp.empty((logits.shape[0], k), xp.float32)),
    "experts": lambda xp, x, *_: xp.empty_like(x),
    "sampling": lambda xp, logits, *_: xp.empty(logits.shape[0], xp.int32),
    "penalties": lambda xp, logits, *_: xp.empty_like(logits),
    "logprobs": lambda xp, logits, chosen, k, *_: (xp.empty(logits.shape[0], xp.float32),
                                                   xp.empty((logits.shape[0], k), xp.int32),
                                                   xp.empty((logits.shape[0], k), xp.float32)),
    "gdn_conv": lambda xp, x, *_: xp.empty_like(x),
    "gated_rms_norm": lambda xp, x, *_: xp.empty_like(x),
    "sigmoid_mul": lambda xp, x, *_: xp.empty_like(x),
    "gdn_rule": lambda xp, q, k, v, *_: xp.empty_like(v),
}


def _moved(v, xp, np):
    """A keyword's host array on the device; a tuple's arrays too (experts' bias=), the rest as given."""
    if isinstance(v, tuple):
        return tuple(_moved(a, xp, np) for a in v)
    return xp.asarray(v) if isinstance(v, np.ndarray) else v


def _eager(op: str, gpu_fn: Callable, xp) -> Callable:
    """gpu_fn with host arrays moved to the device and `out` allocated when not given. `out` may
    come by keyword or, as the gpu wrappers and the numpy ops take it, as the last positional."""
    import inspect

    import numpy as np
    result = _RESULTS.get(op)
    arity = sum(p.kind != p.KEYWORD_ONLY for p in inspect.signature(gpu_fn).parameters.values())

    def call(*args, out=None, **kw):
        if result is not None and len(args) == arity:
            args, out = args[:-1], args[-1]
        args = tuple(xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
        kw = {k: _moved(v, xp, np) for k, v in kw.items()}
        if result is None:                      # kv_write: the caches are the outputs
            return gpu_fn(*args, **kw)
        return gpu_fn(*args, out if out is not None else result(xp, *args), **kw)
    call.__name__, call.__doc__ = f"{op}_gpu", gpu_fn.__doc__
    return call


def get_ops(name: str, *, cpu_dots: str = "f32", fused_decode: bool = True) -> Ops:
    """The ops of backend `name`. cpu_dots: how the numpy backends' linear and experts ops dot
    quantized weights (kernels/qact.py: "int8" rounds activations to 8 bits per 32 values for the
    formats with int8 dots, and to bf16 before bf16 experts; "f32" multiplies by them as they are);
    CUDA computes in fp32, and so do its CPU experts of a bf16 model (moe/runtime.py).
    fused_decode: the cpu backend's decode_layer (same results; False composes the ops)."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; expected {' | '.join(BACKENDS)}")
    modules = {op: importlib.import_module(f"freetoken.kernels.{op}") for op in OP_NAMES}
    if name == "cuda":         # the engine's plan chose it already; a direct caller gets the reason
        reason = cuda_unavailable_reason()
        if reason:
            raise BackendError(f"backend 'cuda' requested but {reason}")
        xp = load_cupy()
        return Ops(name=name, xp=xp, **{op: _eager(op, m.gpu, xp) for op, m in modules.items()})
    import numpy as xp
    ops = {op: getattr(m, name, None) or m.ref for op, m in modules.items()}
    if cpu_dots != "f32":
        from freetoken.kernels.qact import DOTS
        if cpu_dots not in DOTS:
            raise BackendError(f"unknown cpu_dots {cpu_dots!r}; expected {' | '.join(DOTS)}")
        ops.update({op: functools.partial(ops[op], dots=cpu_dots) for op in ("linear", "experts")})
        if cpu_dots == "int8":          # and bf16 experts' activations rounded to bf16 (experts_bf16.py)
            ops["experts"] = functools.partial(ops["experts"], bf16=True)
    if name == "cpu" and fused_decode:
        from freetoken.kernels import decode_layer, decode_stack
        ops["decode_layer"] = functools.partial(decode_layer.cpu, dots=cpu_dots)
        ops["decode_stack"] = functools.partial(decode_stack.cpu, dots=cpu_dots)
    return Ops(name=name, xp=xp, **ops)
