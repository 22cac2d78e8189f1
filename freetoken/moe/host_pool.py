"""The host expert pool, page-locked: the source of truth every fill reads (docs/design.md,
Memory: one expert cache for all layers).

Fills run at link speed only from pinned memory, and the fill kernel reads the banks through the
device's mapping of that memory (UVA), so every layer's banks are pinned and mapped. The banks are
loaded first, in their final layout, and pinned afterwards, one layer at a time with a progress
bar: a writable in-memory bank is registered where it lies (no copy); a read-only one (memory
mapped from safetensors) is copied once into pinned memory. When pinning fails (no driver, a
memlock limit, not enough memory) the pool stays pageable, everything pinned so far is released
and one WARN line says so; the runtime then runs every expert on the CPU.

Shape legend: L MoE layers, E experts, H hidden, I expert width.
"""
from __future__ import annotations

import weakref

import numpy as np

from freetoken.log import Log
from freetoken.kernels.qformats import logical_shape
from freetoken.moe.pool import Bank, check_banks
from freetoken.progress import progress
from freetoken.cupy_loader import cupy as load_cupy

PORTABLE, MAPPED = 1, 2        # cudaHostRegister / cudaHostAlloc flags (same values for both)
# Host ranges this process registered, by address: (bytes, pools using it). Pools over the same
# arrays (engines sharing one loaded model, a rebuilt runtime) share one registration: the
# driver refuses a second one of a range (cudaErrorHostMemoryAlreadyRegistered).
_registered: dict[int, list] = {}


class HostPool:
    """One Bank per MoE layer in host memory; `pinned` says whether it is page-locked and mapped."""

    def __init__(self, banks: list[Bank], pinned: bool, handles=()):
        self.banks = list(banks)
        self.pinned = pinned
        handles = list(handles)            # ("registered", ptr) or ("allocated", PinnedMemory)
        # A pool dropped without close() (an engine garbage-collected) unpins too, before its banks
        # go: a registration outliving its memory makes the driver refuse the next range that
        # malloc places over it (cudaErrorHostMemoryAlreadyRegistered).
        self._unpin = weakref.finalize(self, _release, handles)
        self._unpin.atexit = False         # at exit the context goes, and its registrations with it
        self._views: dict[int, tuple] = {}

    @classmethod
    def pageable(cls, banks) -> "HostPool":
        return cls(_as_banks(banks), pinned=False)

    @property
    def num_layers(self) -> int:
        return len(self.banks)

    @property
    def nbytes(self) -> int:
        return sum(b.gate_up.nbytes + b.down.nbytes for b in self.banks)

    def host(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer j's (gate_up [E,2I,H], down [E,H,I]) as numpy arrays (for the CPU executor)."""
        return self.banks[j].gate_up, self.banks[j].down

    def device_views(self, j: int) -> tuple:
        """Layer j's banks as CuPy arrays over the pinned memory, for kernels that read the host
        pool over the link. Needs a pinned pool (UVA: the host address is the device address)."""
        if not self.pinned:
            raise RuntimeError("the host expert pool is not pinned: the device cannot read it")
        if j not in self._views:
            self._views[j] = tuple(_device_view(a) for a in self.host(j))
        return self._views[j]

    def close(self) -> None:
        """Unpin (idempotent); the banks stay readable as pageable memory."""
        self._unpin()
        self._views.clear()
        self.pinned = False

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pin_host_pool(banks, log=None, *, desc: str = "pinning host experts") -> HostPool:
    """Pin every layer's banks after loading; on failure WARN and return a pageable pool."""
    log, banks = Log(log), _as_banks(banks)
    handles, pinned = [], []
    try:
        cupy = load_cupy()
        in_place = _can_register_in_place(cupy)
        for bank in progress(banks, total=len(banks), desc=desc):
            pinned.append(Bank(*(_pin(cupy, a, in_place, handles) for a in (bank.gate_up, bank.down))))
    except Exception as e:             # CUDARuntimeError, MemoryError, ImportError: all mean "no"
        _release(handles)
        size = sum(b.gate_up.nbytes + b.down.nbytes for b in banks)
        log.warn(f"pinning the host expert pool ({size / 2**30:.2f} GiB) failed "
                 f"({type(e).__name__}: {e}); it stays pageable, so every routed expert runs on "
                 "the CPU (all-CPU fallback)")
        return HostPool(banks, pinned=False)
    log.info(f"host expert pool pinned: {len(banks)} layers, "
             f"{sum(b.gate_up.nbytes + b.down.nbytes for b in pinned) / 2**30:.2f} GiB")
    return HostPool(pinned, pinned=True, handles=handles)


def _as_banks(banks) -> list[Bank]:
    out = [b if isinstance(b, Bank) else Bank(*b) for b in banks]
    if out:
        E, two_i, H = logical_shape(out[0].gate_up)
        check_banks([(b.gate_up, b.down) for b in out], E, H, two_i // 2)
    return out


def _can_register_in_place(cupy) -> bool:
    """Registered memory is usable by kernels at its host address only where the device says so."""
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device().id
    return bool(rt.deviceGetAttribute(rt.cudaDevAttrCanUseHostPointerForRegisteredMem, dev))


def _owns_writable_memory(a: np.ndarray) -> bool:
    # np.memmap (a safetensors file) and views of read-only buffers are copied instead: pinning a
    # file mapping would lock page-cache pages that the file system may still want to evict.
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return (a.flags.writeable and a.flags.c_contiguous and isinstance(base, np.ndarray)
            and not isinstance(base, np.memmap))


def _pin(cupy, a: np.ndarray, in_place: bool, handles: list) -> np.ndarray:
    if a.nbytes == 0:
        return a
    rt = cupy.cuda.runtime
    if in_place and _owns_writable_memory(a):
        ptr = a.ctypes.data
        held = _registered.get(ptr)
        if held is None or held[0] != a.nbytes:
            rt.hostRegister(ptr, a.nbytes, PORTABLE | MAPPED)
            held = _registered[ptr] = [a.nbytes, 0]
        held[1] += 1
        handles.append(("registered", ptr))
        return a
    mem = cupy.cuda.PinnedMemory(a.nbytes, PORTABLE | MAPPED)
    handles.append(("allocated", mem))
    out = np.frombuffer(cupy.cuda.PinnedMemoryPointer(mem, 0), a.dtype, a.size).reshape(a.shape)
    np.copyto(out, a)
    return out


def _release(handles) -> None:
    if not handles:
        return
    cupy = load_cupy()
    for kind, h in reversed(handles):
        if kind == "registered":
            held = _registered.get(h)
            if held is not None and held[1] > 1:
                held[1] -= 1           # another pool still uses the registration
                continue
            _registered.pop(h, None)
            try:
                cupy.cuda.runtime.hostUnregister(h)
            except Exception:          # already gone with the context: nothing left to undo
                pass
    handles.clear()                    # allocated blocks are freed when their last view dies


def _device_view(a: np.ndarray):
    cupy = load_cupy()
    mem = cupy.cuda.UnownedMemory(a.ctypes.data, a.nbytes, a, cupy.cuda.Device().id)
    return cupy.ndarray(a.shape, a.dtype, cupy.cuda.MemoryPointer(mem, 0))
