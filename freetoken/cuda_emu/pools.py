"""Allocators of the emulated device: CuPy's default memory pool, private pools (what graph capture
may allocate from), ``using_allocator``, and the pinned memory pool.

A pool here hands out fresh guard-paged allocations (memory.Allocation) and caches nothing: a
block is unmapped once nothing refers to it (queued operations keep what they touch, as CuPy's
stream-ordered frees allow), so a use after free faults instead of reading a recycled block.
"""
from __future__ import annotations

import contextlib
import threading

from freetoken.cuda_emu import memory
from freetoken.cuda_emu.streams import allow_capture_allocations

_local = threading.local()


class MemoryPointer:
    """cupy.cuda.MemoryPointer: (memory object, offset) with .ptr."""

    def __init__(self, mem, offset: int):
        self.mem, self.ptr = mem, int(mem.ptr) + int(offset)

    def __int__(self) -> int:
        return self.ptr


class UnownedMemory:
    """cupy.cuda.UnownedMemory: memory someone else owns (a pinned host bank seen through UVA)."""

    def __init__(self, ptr: int, size: int, owner, device_id: int = 0):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id


def allocate(nbytes: int, what: str) -> "MemoryPointer":
    """A MemoryPointer from the allocator in use (using_allocator's, else the default pool)."""
    return current_allocator()(nbytes, what)


class _Raw:
    def __init__(self, ptr):
        self.ptr = ptr



class MemoryPool:
    """cupy.cuda.MemoryPool. A pool other than the default one is private: graph capture may
    allocate from it (the graphs keep its blocks)."""

    def __init__(self, allocator=None, _default: bool = False):
        self._default = _default
        self._live = 0

    def malloc(self, size: int, what: str = "") -> "MemoryPointer":
        if self._default:
            return MemoryPointer(memory.Allocation(size, what), 0)
        with allow_capture_allocations():
            return MemoryPointer(memory.Allocation(size, what + " (private pool)"), 0)

    def free_all_blocks(self, stream=None) -> None:
        pass                                   # nothing is cached

    def used_bytes(self) -> int:
        return memory.DEVICE.used

    def total_bytes(self) -> int:
        return memory.DEVICE.used

    def n_free_blocks(self) -> int:
        return 0

    def set_limit(self, size=None, fraction=None) -> None:
        raise NotImplementedError("emulated CuPy: MemoryPool.set_limit (set FREETOKEN_CUDA_EMULATE_MEMORY)")


_DEFAULT = MemoryPool(_default=True)


def get_default_memory_pool() -> MemoryPool:
    return _DEFAULT


class PinnedMemoryPool:
    def free_all_blocks(self) -> None:
        pass

    def n_free_blocks(self) -> int:
        return 0


_PINNED_POOL = PinnedMemoryPool()


def get_default_pinned_memory_pool() -> PinnedMemoryPool:
    return _PINNED_POOL


def current_allocator():
    """allocator(nbytes, what) -> MemoryPointer: the using_allocator one, else the default pool."""
    alloc = getattr(_local, "allocator", None)
    if alloc is None:
        return _DEFAULT.malloc
    return lambda n, what="": _call_user_allocator(alloc, n, what)


def _call_user_allocator(alloc, n, what):
    owner = getattr(alloc, "__self__", None)
    if isinstance(owner, MemoryPool):
        return alloc(n, what)
    return alloc(n)


@contextlib.contextmanager
def using_allocator(allocator=None):
    """cupy.cuda.using_allocator: allocations in the block come from `allocator`."""
    old = getattr(_local, "allocator", None)
    _local.allocator = allocator
    try:
        yield
    finally:
        _local.allocator = old


def set_allocator(allocator=None) -> None:
    _local.allocator = allocator
