"""How the emulated ndarray's operations run: each is a closure on the current stream (streams.py);
an operation that makes new arrays sizes them by a dry run of the same numpy call on zeros, and
reads of values on the host synchronise the stream first."""
from __future__ import annotations

import numpy as np

from freetoken.cuda_emu import hazards
from freetoken.cuda_emu import ndarray as nd
from freetoken.cuda_emu.streams import get_current_stream, host_sync


def enqueue(name: str, fn, reads=(), writes=()) -> None:
    get_current_stream().enqueue(fn, name, hazards.arrays_ranges(reads, writes))


def sync_current(what: str, stream=None) -> None:
    host_sync(what)
    (stream or get_current_stream()).drain_for_host()


def from_host(host: np.ndarray) -> "nd.ndarray":
    """A new device array holding a copy of host data (written at once: a blocking copy)."""
    host = np.ascontiguousarray(host)
    out = nd.ndarray(host.shape, host.dtype)
    np.copyto(out._a, host)
    return out


def _alloc_like(meta):
    if isinstance(meta, tuple):
        return tuple(_alloc_like(m) for m in meta)
    meta = np.asarray(meta)
    return nd.ndarray(meta.shape, meta.dtype)


def _store(out, result, name: str) -> None:
    if isinstance(out, tuple):
        for o, r in zip(out, result):
            _store(o, r, name)
        return
    result = np.asarray(result)
    if result.shape != out.shape:
        raise RuntimeError(f"{name}: result shape {result.shape} depends on device data "
                           f"(the dry run gave {out.shape}); use a synchronising call")
    np.copyto(out._a, result, casting="unsafe")


def deferred(name: str, fn, args: tuple, kwargs: dict | None = None):
    """fn(*args) on the current stream, into new device arrays sized by a dry run on zeros."""
    kwargs = kwargs or {}
    with np.errstate(all="ignore"):
        meta = fn(*nd._meta(args), **nd._meta(kwargs))
    out = _alloc_like(meta)
    real_args = args       # device arrays stay referenced until the closure has run

    def run():
        with np.errstate(all="ignore"):
            _store(out, fn(*nd._real(real_args), **nd._real(kwargs)), name)
    enqueue(name, run, (args, tuple((kwargs or {}).values())), (out,))
    return out
