"""Modules and kernels of device_code.py: the ``extern "C" __global__`` signatures of a source, the
argument checks and packing (one pointer per parameter, cuLaunchKernel style), the launch-shape
checks the device would make, and the call into the runtime (ctypes: the GIL is released while
the kernel runs)."""
from __future__ import annotations

import ctypes
import os
import re
import struct
from pathlib import Path

import numpy as np

from freetoken.cuda_emu import device_code as dc
from freetoken import device_limits

_BOUNDS = r"(?:__launch_bounds__\s*\([^)]*\)\s+)?"      # allowed before or after `void`
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+' + _BOUNDS + r"void\s+" + _BOUNDS +
                    r"(\w+)\s*\(([^)]*)\)", re.S)
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict)\b")
# the numpy scalar type a launch must pass for each by-value parameter type
SCALAR_TYPES = {
    "int": np.int32, "signed": np.int32, "signed int": np.int32, "int32_t": np.int32,
    "unsigned": np.uint32, "unsigned int": np.uint32, "u32": np.uint32, "uint32_t": np.uint32,
    "long long": np.int64, "long long int": np.int64, "long": np.int64, "int64_t": np.int64,
    "unsigned long long": np.uint64, "unsigned long": np.uint64, "size_t": np.uint64,
    "uint64_t": np.uint64, "short": np.int16, "unsigned short": np.uint16, "u16": np.uint16,
    "char": np.int8, "signed char": np.int8, "unsigned char": np.uint8, "bool": np.bool_,
    "float": np.float32, "double": np.float64,
}


class Param:
    """One kernel parameter: ``ctype`` as written (qualifiers dropped); ``scalar`` is the numpy
    type to pass, None for a pointer (a device address, an int); ``const`` for read-only ones."""

    def __init__(self, text: str):
        words = _QUALIFIERS.sub(" ", text).replace("*", " * ").split()
        self.name, self.pointer = words[-1], "*" in words
        self.const = "const" in re.findall(r"\w+", text)   # read-only: the launch checks skip it
        self.ctype = " ".join(w for w in words[:-1] if w != "*") + " *" * words.count("*")
        self.scalar = None if self.pointer else SCALAR_TYPES.get(" ".join(words[:-1]))


def entries(code: str) -> dict[str, list[Param]]:
    """{entry: [Param, ...]} of every ``extern "C" __global__`` function in ``code``."""
    return {name: [Param(p) for p in params.split(",") if p.strip()]
            for name, params in _ENTRY.findall(code)}


def _source_name(code: str) -> str:
    m = re.match(r'#line\s+\d+\s+"([^"]+)"', code)
    return m.group(1) if m else "<source>"


class Module:
    """A built and loaded kernel library."""

    def __init__(self, path, found: dict[str, list[Param]], code: str, runtime):
        self._lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self._runtime, self._entries, self._kernels = runtime, found, {}
        self.source = _source_name(code)
        lo, hi = ctypes.c_void_p(), ctypes.c_void_p()
        self._lib.emu_shared_section(ctypes.byref(lo), ctypes.byref(hi))
        self.static_shared = (lo.value, hi.value)

    def get_function(self, name: str) -> "Kernel":
        """The entry ``name``; one object per name, so its attributes are per function, as on
        the device."""
        if name not in self._entries:
            raise KeyError(f'no extern "C" __global__ function {name!r} in {self.source} '
                           f"(it has: {', '.join(sorted(self._entries)) or 'none'})")
        if name not in self._kernels:
            fn = ctypes.cast(getattr(self._lib, f"emu_entry_{name}"), ctypes.c_void_p).value
            self._kernels[name] = Kernel(self, name, self._entries[name], fn)
        return self._kernels[name]


class Kernel:
    def __init__(self, module: Module, name: str, params: list[Param], fn: int):
        self.name, self.params, self._module, self._fn = name, params, module, fn
        self._max_dyn = 0
        for p in params:
            if not p.pointer and p.scalar is None:
                raise TypeError(f"kernel {name}: parameter {p.name} has type {p.ctype!r}, which "
                                "the emulator cannot pass (no numpy scalar type for it)")

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dyn

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        if not 0 <= int(n) <= dc.OPTIN_SMEM:
            raise ValueError(f"kernel {self.name}: max_dynamic_shared_size_bytes {n} is outside "
                             f"[0, {dc.OPTIN_SMEM}] (the device's opt-in maximum)")
        self._max_dyn = int(n)

    @property
    def max_threads_per_block(self) -> int:
        """As a device reports it: the table's register rule for the project's kernels."""
        mine = device_limits.row_of(Path(self._module.source).name, self.name) is not None
        return device_limits.max_threads(self.name) if mine else dc.MAX_THREADS

    def launch(self, grid, block, shared_mem: int, args) -> None:
        """Runs the kernel to completion; EmuFault on a bad launch shape or a fault while it
        runs, TypeError on arguments that do not match the signature."""
        grid, block, shared_mem = _dim3(grid), _dim3(block), int(shared_mem)
        self.check_shape(grid, block, shared_mem)
        args = list(args)
        slots, params = self._pack(args)
        lo, hi = self._module.static_shared
        la = dc._LaunchArgs(self._fn, ctypes.addressof(params), grid, block, shared_mem, lo, hi,
                            self.name.encode())
        info = dc._FaultInfo()
        rc = self._module._runtime.emu_launch(ctypes.byref(la), ctypes.byref(info))
        if rc:
            raise dc.EmuFault(dc.symbolize(info.message.decode(errors="replace")), kernel=self.name,
                              address=int(info.address) if info.has_address else None)
        for p, v in zip(self.params, args):
            if p.pointer and (how := dc.slack_write(int(v))):
                raise self._fault(f"wrote outside the allocation its parameter {p.name} points "
                                  f"into: {how}")

    def _fault(self, message: str):
        return dc.EmuFault(f"kernel {self.name}: {message}", kernel=self.name)

    def check_shape(self, grid, block, shared_mem: int) -> None:
        shape = f"grid {grid}, block {block}"
        if min(grid + block) < 1:
            raise self._fault(f"invalid launch: a zero or negative dimension ({shape})")
        threads = block[0] * block[1] * block[2]
        if threads > dc.MAX_THREADS or any(b > m for b, m in zip(block, dc.MAX_BLOCK)):
            raise self._fault(f"invalid launch: block {block} ({threads} threads) exceeds the "
                              f"device limits ({dc.MAX_THREADS} threads, dims {dc.MAX_BLOCK})")
        if any(g > m for g, m in zip(grid, dc.MAX_GRID)):
            raise self._fault(f"invalid launch: grid {grid} exceeds the device limits {dc.MAX_GRID}")
        limit = max(dc.DEFAULT_SMEM, self._max_dyn)
        if not 0 <= shared_mem <= limit:
            raise self._fault(
                f"invalid launch: {device_limits.TOO_MUCH_SHARED} ({shared_mem} bytes of dynamic "
                f"shared memory; the limit is {limit}"
                f" (above {dc.DEFAULT_SMEM} needs max_dynamic_shared_size_bytes >= the size, at "
                f"most {dc.OPTIN_SMEM}))")
        if (why := device_limits.refusal(Path(self._module.source).name, self.name,
                                             threads, shared_mem, self._max_dyn)):
            raise self._fault(f"invalid launch ({shape}, {shared_mem} bytes of dynamic shared "
                              f"memory): {why}; cuda/{device_limits.TABLE}")

    def _pack(self, args):
        """(value storage, void* array): parameter i's value in 8-byte slot i."""
        if len(args) != len(self.params):
            names = ", ".join(p.name for p in self.params)
            raise TypeError(f"kernel {self.name}: {len(args)} arguments for {len(self.params)} "
                            f"parameters ({names})")
        slots = ctypes.create_string_buffer(8 * max(1, len(args)))
        for i, (p, v) in enumerate(zip(self.params, args)):
            if p.pointer:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                        or not 0 <= int(v) < 2**64:
                    raise TypeError(f"kernel {self.name}: parameter {p.name} ({p.ctype}) takes a "
                                    f"device address (int), not {v!r}")
                struct.pack_into("<Q", slots, 8 * i, int(v))
            else:
                if type(v) is not p.scalar:
                    raise TypeError(f"kernel {self.name}: parameter {p.name} ({p.ctype}) takes "
                                    f"numpy.{p.scalar.__name__}, not {type(v).__name__} {v!r}")
                ctypes.memmove(ctypes.addressof(slots) + 8 * i, v.tobytes(), v.nbytes)
        base = ctypes.addressof(slots)
        params = (ctypes.c_void_p * max(1, len(args)))(*[base + 8 * i for i in range(len(args))])
        return slots, params


def _dim3(d) -> tuple[int, int, int]:
    d = (int(d),) if isinstance(d, (int, np.integer)) else tuple(int(v) for v in d)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"a launch dimension has 1 to 3 components, not {d}")
    return (d + (1, 1, 1))[:3]
