"""glibc malloc settings for the host arrays a forward allocates and frees (``--host-scratch-reuse``).

Why: a prefill makes and drops arrays of 0.1-32 MB in every op of every layer (each token's
activations, the routed experts' gate/up rows, the int8 tiles). glibc's defaults give arrays over
128 KB fresh mmaps until its threshold has adapted, and hand the top of the heap back to the system
as soon as more than twice that is free there, so each prompt page-faults its scratch in again:
~31,000 minor faults for a 512-token prefill of the medium synthetic model, and a page fault costs
microseconds (far more inside a VM sandbox). Two settings make later prompts reuse those pages:

  M_MMAP_THRESHOLD 32 MB   arrays up to glibc's largest threshold come from the heap from the first
                           prompt on (it no longer adapts; larger arrays stay mmaps of their own)
  M_TOP_PAD 64 MB          the heap keeps 64 MB at its top when trimming, and grows by that much

Process-wide: applied once, at the first engine's start, and logged; a process not on glibc, or
whose malloc is another allocator's (jemalloc or tcmalloc by LD_PRELOAD: glibc's mallopt would
return 1 and change nothing), keeps its allocator and says so. Peak RSS is unchanged (the pages kept are the ones a prompt just used).
"""
from __future__ import annotations

import ctypes
import platform
import threading

# glibc's mallopt parameter numbers (malloc.h)
M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3
MMAP_THRESHOLD = 32 << 20       # glibc's upper bound for the threshold on 64-bit (HEAP_MAX_SIZE / 2)
TOP_PAD = 64 << 20

_lock = threading.Lock()
_applied: str | None = None      # what the first call did; later calls change nothing, log it again


def reuse_freed_scratch(logger) -> str:
    """Set both parameters (once a process) and log, at every engine's start, what was done."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _set_parameters()
    logger.info("%s", _applied)
    return _applied


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def malloc_library() -> str | None:
    """The file of the library whose ``malloc`` this process calls (dladdr), or None if unknown."""
    try:
        process = ctypes.CDLL(None)
        dladdr = process.dladdr
    except (OSError, AttributeError):
        return None
    dladdr.argtypes, dladdr.restype = (ctypes.c_void_p, ctypes.POINTER(_DlInfo)), ctypes.c_int
    info = _DlInfo()
    if not dladdr(ctypes.cast(process.malloc, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode(errors="replace")


def _set_parameters() -> str:
    libc_name = platform.libc_ver()[0]
    if libc_name != "glibc":
        return f"host malloc: left as it is (the C library is {libc_name or 'unknown'}, not glibc)"
    owner = malloc_library()
    if owner is not None and "libc.so" not in owner.rsplit("/", 1)[-1]:
        return f"host malloc: left as it is (malloc comes from {owner}, not glibc: mallopt would not reach it)"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    failed = [name for name, param, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                              ("M_TOP_PAD", M_TOP_PAD, TOP_PAD))
              if mallopt(param, value) != 1]
    if failed:
        return f"host malloc: glibc refused {', '.join(failed)}; freed scratch may be faulted in again"
    return (f"host malloc: arrays up to {MMAP_THRESHOLD >> 20} MB from the heap and {TOP_PAD >> 20} MB "
            "kept at its top (glibc mallopt), so each prompt reuses freed scratch pages instead of "
            "faulting in new ones (--no-host-scratch-reuse leaves malloc as it was)")
