"""cupy.RawModule / cupy.RawKernel of the emulated device: the real .cu source, built by the host
compiler (device_code.py), launched as a closure on the current stream.

After each launch the arrays the kernel may write (its non-const pointer parameters) are compared
with their bytes before it: a NaN it wrote while one of its inputs holds never-written (poison)
words is reported as a read of unwritten device memory, naming the kernel, the output and the
input. Outputs over CHECK_BYTES are not compared (the copy would dominate the run).

``launches`` counts the kernel launches the host has made (each ``RawKernel.__call__`` that got
onto a stream; one captured into a graph counts once, its replays do not; array operations are
not kernels here), so a test can assert that a call launched nothing, or exactly one kernel.
"""
from __future__ import annotations

import numpy as np

from freetoken.cuda_emu import hazards, memory
from freetoken.cuda_emu.ndarray import ndarray
from freetoken.cuda_emu.streams import get_current_stream

CHECK_BYTES = 16 << 20
launches = 0        # RawKernel launches so far in this process (see the module docstring)


class RawModule:
    """cupy.RawModule(code=..., options=...): built on construction (errors surface here)."""

    def __init__(self, code: str | None = None, *, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, enable_cooperative_groups=False, name_expressions=None,
                 jitify=False):
        from freetoken.cuda_emu import device_code
        if code is None:
            raise NotImplementedError("emulated CuPy: RawModule(path=...) (cubin/ptx) is not emulated")
        self.code, self.options = code, tuple(options)
        self._module = device_code.build(code, self.options)
        from freetoken.cuda_emu.device_launch import entries
        self._signatures = {name: [(p.name, p.pointer, p.const) for p in params]
                            for name, params in entries(code).items()}

    def get_function(self, name: str) -> "RawKernel":
        return RawKernel._from_module(self, name)


class RawKernel:
    """One entry point; ``kern(grid, block, args, shared_mem=0, stream=None)`` enqueues it."""

    def __init__(self, code: str, name: str, options=(), **kw):
        k = RawModule(code=code, options=options).get_function(name)
        self.__dict__.update(k.__dict__)

    @classmethod
    def _from_module(cls, module: RawModule, name: str) -> "RawKernel":
        obj = cls.__new__(cls)
        obj.name, obj._kernel = name, module._module.get_function(name)
        obj._params = module._signatures.get(name)
        return obj

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._kernel.max_dynamic_shared_size_bytes

    @property
    def max_threads_per_block(self) -> int:
        """The largest block this entry launches, as a device reports it from the loaded code's
        registers: here ptxas's offline count (device_limits.max_threads)."""
        return self._kernel.max_threads_per_block

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        self._kernel.max_dynamic_shared_size_bytes = int(n)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        global launches
        grid, block = _dim3(grid), _dim3(block)
        self._kernel.check_shape(grid, block, int(shared_mem))   # as CUDA: a bad shape fails at the launch
        values = [a.data.ptr if isinstance(a, ndarray) else a for a in args]
        arrays = [a if isinstance(a, ndarray) else None for a in args]   # alive until it runs
        if any(isinstance(a, np.ndarray) for a in args):
            raise TypeError(f"kernel {self.name}: a host numpy array passed as a kernel argument")
        stream = stream if stream is not None else get_current_stream()
        stream.enqueue(lambda: self._run(grid, block, int(shared_mem), values, arrays),
                       f"kernel {self.name}", self._ranges(args))
        launches += 1

    def _ranges(self, args) -> list:
        """The device bytes the launch may touch: each array argument, each raw pointer to the
        end of its allocation; written unless its parameter is const (hazards.py)."""
        out = []
        for (_, is_ptr, is_const), a in zip(self._param_table(len(args)), args):
            r = hazards.array_range(a, not is_const) if isinstance(a, ndarray) else \
                hazards.pointer_range(a, not is_const) if is_ptr and isinstance(a, (int, np.integer)) else None
            if r is not None:
                out.extend(hazards.narrowed(r))
        return out

    def _run(self, grid, block, shared_mem, values, arrays) -> None:
        from freetoken.cuda_emu import device_code
        outputs = self._outputs(arrays)
        before = [a._a.copy() for _, a in outputs]
        try:
            self._kernel.launch(grid, block, shared_mem, values)
        except device_code.EmuFault as e:
            if e.address is None:           # not a memory fault: nothing to add
                raise
            raise device_code.EmuFault(f"{e} [{memory.describe_address(e.address)}]", kernel=e.kernel,
                                       address=e.address) from None
        for (name, a), old in zip(outputs, before):
            self._check_nan(name, a, old, arrays)

    def _param_table(self, n: int) -> list:
        """(name, pointer, const) per parameter; a kernel without a parsed signature: n
        writable pointers."""
        return self._params or [(f"arg{i}", True, False) for i in range(n)]

    def _outputs(self, arrays):
        return [(p[0], a) for p, a in zip(self._param_table(len(arrays)), arrays)
                if a is not None and p[1] and not p[2] and a.nbytes <= CHECK_BYTES
                and a.dtype in (np.float32, np.uint16)]

    def _check_nan(self, name, a: ndarray, old: np.ndarray, arrays) -> None:
        new = a._a
        bits = np.uint32 if new.dtype == np.float32 else np.uint16   # poison NaN keeps its bits
        fresh = _nan(new) & (new.view(bits) != old.view(bits))
        count = int(np.count_nonzero(fresh))
        if not count:
            return
        params = self._params or []
        for (pname, is_ptr, is_const), arg in zip(params, arrays):
            poisoned = memory.poison_count(arg._a) if arg is not None and is_const else 0
            if poisoned:
                raise memory_fault(self.name, (
                    f"wrote NaN into {count} elements of `{name}` while its input `{pname}` holds "
                    f"{poisoned} never-written words (poison 0x{memory.POISON16:04X}): "
                    "it read device memory no one wrote"))


def memory_fault(kernel: str, message: str):
    from freetoken.cuda_emu import device_code
    return device_code.EmuFault(f"kernel {kernel}: {message}", kernel=kernel, address=None)


def _nan(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float32:
        return np.isnan(a)
    return (a & 0x7FFF) > 0x7F80                     # bf16 bits


def _dim3(d) -> tuple[int, int, int]:
    d = (int(d),) if isinstance(d, (int, np.integer)) else tuple(int(v) for v in d)
    return (d + (1, 1, 1))[:3]
