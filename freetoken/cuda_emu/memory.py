"""Device memory of the emulated device: guard-paged, poison-filled allocations (device_code.alloc),
a registry that names the allocation behind any address, pinned host memory, and the byte budget
that runtime.memGetInfo reports.

Poison: every new allocation holds the 16-bit pattern 0xFFC7 (a NaN as bf16 and as f32, an absurd
index as int32), so a kernel that reads memory nobody wrote computes NaN or faults, and a copy back
to the host that still holds the pattern is reported (``check_written``).
"""
from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
import weakref

import numpy as np

POISON16 = 0xFFC7
POISON_WORDS = {2: np.uint16(POISON16), 4: np.uint32(0xFFC7FFC7), 8: np.uint64(0xFFC7FFC7FFC7FFC7)}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
DEFAULT_DEVICE_BYTES = 2 << 30


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError: the emulated device's budget is spent."""


class CaptureError(RuntimeError):
    """Something a CUDA graph capture forbids (as the driver would report it)."""


def device_bytes() -> int:
    """The emulated device's size: FREETOKEN_CUDA_EMULATE_MEMORY (bytes, or with a K/M/G suffix)."""
    raw = os.environ.get("FREETOKEN_CUDA_EMULATE_MEMORY", "").strip().upper().removesuffix("IB").removesuffix("B")
    if not raw:
        return DEFAULT_DEVICE_BYTES
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1], 1)
    return int(float(raw.rstrip("KMG")) * scale)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _caller() -> str:
    """file:line of the first frame outside the stand-in: where an allocation was made."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f else "?"


class Registry:
    """Live ranges [start, end) -> what they are; one lock, because the engine and CPU threads share it."""

    def __init__(self):
        self._starts: list[int] = []
        self._items: list[tuple[int, int, object]] = []
        self._lock = threading.Lock()
        self.used = 0

    def add(self, start: int, end: int, item) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._items.insert(i, (start, end, _weak(item)))

    def remove(self, start: int, item=None) -> None:
        """Forget the range starting at `start` (the one holding `item` when several do)."""
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            while i < len(self._items) and self._items[i][0] == start:
                if item is None or self._items[i][2]() is item:
                    del self._starts[i], self._items[i]
                    return
                i += 1

    def below(self, addr: int):
        """(start, end, item) of the live range starting at or below addr, else None."""
        with self._lock:
            i = bisect.bisect(self._starts, addr) - 1
            if i >= 0 and self._items[i][2]() is not None:
                s, e, ref = self._items[i]
                return s, e, ref()
        return None

    def find(self, addr: int):
        """(start, end, item) holding addr, else None."""
        hit = self.below(addr)
        return hit if hit is not None and addr < max(hit[1], hit[0] + 1) else None


def _weak(item):
    """The registry must not keep an allocation alive: weak where the item allows it."""
    try:
        return weakref.ref(item)
    except TypeError:
        return lambda: item


DEVICE = Registry()          # device allocations
PINNED = Registry()          # pinned / registered host ranges (async copies really are async)
_CAPTURE_GUARD: list = []    # set by streams.py: a callable raising when an allocation is illegal


class Allocation:
    """One device allocation; freed (and its bytes returned to the budget) when unreachable."""

    def __init__(self, nbytes: int, what: str = ""):
        from freetoken.cuda_emu import device_code
        for guard in _CAPTURE_GUARD:
            guard(f"device allocation of {nbytes} bytes ({what or 'raw'}) at {_caller()}")
        if DEVICE.used + nbytes > device_bytes():
            raise OutOfMemoryError(
                f"Out of memory allocating {nbytes:,} bytes (allocated so far: {DEVICE.used:,} bytes "
                f"of the emulated device's {device_bytes():,}; FREETOKEN_CUDA_EMULATE_MEMORY sets it)")
        self.nbytes, self.site = int(nbytes), f"{what} allocated at {_caller()}".strip()
        self.ptr = device_code.alloc(self.nbytes)
        DEVICE.used += self.nbytes
        DEVICE.add(self.ptr, self.ptr + self.nbytes, self)
        weakref.finalize(self, _free, self.ptr, self.nbytes)

    def describe(self, addr: int) -> str:
        off = addr - self.ptr
        where = f"byte {off} of" if 0 <= off < self.nbytes else f"{off - self.nbytes} bytes past the end of"
        return f"{where} a {self.nbytes}-byte device allocation ({self.site})"


def _free(ptr: int, nbytes: int) -> None:
    from freetoken.cuda_emu import device_code, hazards
    hazards.freed(ptr)
    DEVICE.remove(ptr)
    DEVICE.used -= nbytes
    device_code.free(ptr)


def describe_address(addr: int | None) -> str:
    """What a faulting address is: inside/just past a device allocation, or unknown memory."""
    if addr is None:
        return "address unknown"
    hit = DEVICE.below(addr)
    if hit is not None and addr - hit[1] < 2 * 4096:     # inside, or in the guard page after it
        return f"address {addr:#x}: {hit[2].describe(addr)}"
    return f"address {addr:#x}: not in any live device allocation"


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    """uint8[nbytes] over raw memory at ptr (device memory is host memory here). A view into a
    device allocation keeps it alive: a numpy array outliving its allocation would read unmapped
    pages (pytest printing a failed test's locals crashed so)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    hit = DEVICE.find(ptr)
    buf.owner = hit[2] if hit is not None else None
    return np.frombuffer(buf, np.uint8)


def owners(ranges) -> list:
    """The live device allocations and pinned buffers holding ``ranges`` ((lo, hi, write)): a
    queued operation keeps them, as CuPy's pools do not hand out a block that queued work still
    uses (frees in stream order; pinned blocks watched by an event), so an array dropped after
    its last use was queued does not go away under that use."""
    hits = (DEVICE.find(lo) or PINNED.find(lo) for lo, hi, _ in ranges if hi > lo)
    return [hit[2] for hit in hits if hit is not None]


def poison_count(view: np.ndarray) -> int:
    """Words of `view` (a numpy array) still holding the poison pattern of their width."""
    size = view.dtype.itemsize
    if size not in POISON_WORDS or view.size == 0:
        return 0
    return int(np.count_nonzero(np.ascontiguousarray(view).view(_UINT[size]) == POISON_WORDS[size]))


def check_written(view: np.ndarray, what: str, site: str) -> None:
    """Raise when `view` (about to be read by the host) holds never-written device words."""
    n = poison_count(view)
    if n:
        flat = np.ascontiguousarray(view).view(_UINT[view.dtype.itemsize]).ravel()
        first = int(np.flatnonzero(flat == POISON_WORDS[view.dtype.itemsize])[0])
        raise RuntimeError(
            f"{what}: {n} of {view.size} elements were never written on the device, or were computed "
            f"from memory never written (first at flat index {first}; {site}); new allocations hold "
            f"the poison pattern 0x{POISON16:04X}")


def is_pinned(addr: int) -> bool:
    return PINNED.find(addr) is not None


class PinnedMemory:
    """cupy.cuda.PinnedMemory: page-locked host memory (async copies from it really are async)."""

    def __init__(self, size: int, flags: int = 0):
        self.size = int(size)
        self._buf = np.zeros(max(self.size, 1), np.uint8)
        self.ptr = self._buf.ctypes.data
        PINNED.add(self.ptr, self.ptr + self.size, self)
        weakref.finalize(self, PINNED.remove, self.ptr)


def PinnedMemoryPointer(mem: PinnedMemory, offset: int):
    """A buffer over pinned memory (np.frombuffer accepts it), with .ptr and .mem like CuPy's."""
    buf = (ctypes.c_char * (mem.size - offset)).from_buffer(mem._buf, offset)
    buf.ptr, buf.mem = mem.ptr + offset, mem
    return buf


def alloc_pinned_memory(size: int):
    return PinnedMemoryPointer(PinnedMemory(size), 0)


def host_register(ptr: int, size: int, flags: int = 0) -> None:
    key = _Registered(ptr)
    if PINNED.find(ptr) is not None:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered: cudaHostRegister of a range "
                           f"already registered ({ptr:#x})")
    PINNED.add(ptr, ptr + size, key)
    _REGISTERED[ptr] = key


def host_unregister(ptr: int) -> None:
    key = _REGISTERED.pop(ptr, None)
    if key is None:
        raise RuntimeError(f"cudaErrorHostMemoryNotRegistered: cudaHostUnregister({ptr:#x})")
    PINNED.remove(ptr, key)


class _Registered:
    def __init__(self, ptr: int):
        self.ptr = ptr


_REGISTERED: dict[int, _Registered] = {}
