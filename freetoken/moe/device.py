"""Where the device MoE runtime's arrays live and how its copies are ordered: two implementations.

``CudaDevice``: CuPy arrays; the compute stream is whatever stream is current when the runtime is
called (the model's); fills and prefill loads run on one dedicated non-blocking copy stream,
ordered against compute with events; D2H/H2D go through pinned staging buffers with
cudaMemcpyAsync on the compute stream. ``HostDevice``: numpy arrays, and every "async" operation is
done on the spot; the CPU engine runs the MoE runtime over it.

Each has: ``xp``, ``residency(L, E, S)``, ``needs_pinning``, ``host_memory``, ``host_views(host_pool, j)``,
``to_device(a)``, ``to_host(a)``, ``pinned(shape, dtype)``, ``d2h(dst, src)``, ``h2d(dst, src)``, ``event()``,
``record(ev, on_copy=False)``, ``wait(ev, on_copy=False)``, ``synchronize(ev)``, ``copy_stream()``
(a context manager making the copy stream current), ``free_cached()``.

``host_memory`` is the one capability the runtime specialises on, once, at construction: the
device's arrays are host arrays and every operation is done when it returns. Then every expert is
already "resident" (prefill and fused read the host bank in place), and the CPU branch needs no
staging and can start before the device op instead of after it (cpu_branch.py).
"""
from __future__ import annotations

import contextlib

import numpy as np
from freetoken.cupy_loader import cupy as load_cupy


class HostDevice:
    """The host standing in for the device: arrays are numpy, copies are memcpy, events are no-ops."""

    needs_pinning = False
    host_memory = True
    name = "host"

    def __init__(self):
        self.xp = np

    def residency(self, num_layers: int, num_experts: int, num_slots: int):
        from freetoken.moe.residency_gpu import HostResidency
        return HostResidency(num_layers, num_experts, num_slots)

    def host_views(self, host_pool, j: int):
        return host_pool.host(j)

    def to_device(self, a):
        return np.ascontiguousarray(a)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def pinned(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def d2h(self, dst: np.ndarray, src) -> None:
        np.copyto(dst, src)

    def h2d(self, dst, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def event(self):
        return None

    def record(self, ev, on_copy: bool = False) -> None:
        pass

    def wait(self, ev, on_copy: bool = False) -> None:
        pass

    def synchronize(self, ev) -> None:
        pass

    def copy_stream(self):
        return contextlib.nullcontext()

    def free_cached(self) -> None:
        pass


class CudaDevice:
    """CuPy on the current device; one copy stream for fills and prefill loads."""

    needs_pinning = True
    host_memory = False
    name = "cuda"

    def __init__(self):
        cupy = load_cupy()
        self._cp = self.xp = cupy
        self._copy = cupy.cuda.Stream(non_blocking=True)   # never implicitly ordered with compute

    def residency(self, num_layers: int, num_experts: int, num_slots: int):
        from freetoken.moe.residency_gpu import GpuResidency
        return GpuResidency(num_layers, num_experts, num_slots)

    def host_views(self, host_pool, j: int):
        return host_pool.device_views(j)

    def to_device(self, a):
        return self._cp.asarray(np.ascontiguousarray(a))

    def to_host(self, a) -> np.ndarray:
        return self._cp.asnumpy(a)

    def pinned(self, shape, dtype) -> np.ndarray:
        """A pinned numpy array (async copies); pageable when pinning fails (copies then block)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        try:
            mem = self._cp.cuda.alloc_pinned_memory(max(n, 1))
        except Exception:
            return np.empty(shape, dtype)
        return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)

    def _memcpy(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        rt = self._cp.cuda.runtime
        stream = self._cp.cuda.get_current_stream()
        rt.memcpyAsync(dst_ptr, src_ptr, nbytes, rt.memcpyDefault, stream.ptr)

    def d2h(self, dst: np.ndarray, src) -> None:
        """Enqueue device -> host on the current stream; dst must stay alive until it is done."""
        assert dst.flags.c_contiguous and src.flags.c_contiguous and dst.nbytes == src.nbytes
        self._memcpy(dst.ctypes.data, src.data.ptr, dst.nbytes)

    def h2d(self, dst, src: np.ndarray) -> None:
        assert dst.flags.c_contiguous and src.flags.c_contiguous and dst.nbytes == src.nbytes
        self._memcpy(dst.data.ptr, src.ctypes.data, dst.nbytes)

    def event(self):
        return self._cp.cuda.Event(disable_timing=True)

    def _stream(self, on_copy: bool):
        return self._copy if on_copy else self._cp.cuda.get_current_stream()

    def record(self, ev, on_copy: bool = False) -> None:
        ev.record(self._stream(on_copy))     # named: Event.record() alone takes the current stream

    def wait(self, ev, on_copy: bool = False) -> None:
        self._stream(on_copy).wait_event(ev)

    def synchronize(self, ev) -> None:
        ev.synchronize()

    def copy_stream(self):
        return self._copy

    def free_cached(self) -> None:
        """Hand freed pool blocks back to the driver (before a larger pool is allocated)."""
        self._cp.cuda.Device().synchronize()
        self._cp.get_default_memory_pool().free_all_blocks()


def device_for(backend: str):
    """The MoE device of an ops backend (backend.get_ops): CudaDevice for "cuda", else HostDevice."""
    return CudaDevice() if backend == CudaDevice.name else HostDevice()


def gpu_identity() -> tuple[str, str] | None:
    """(UUID as nvidia-smi prints it, name) of the current GPU, or None without one."""
    try:
        import uuid

        cupy = load_cupy()
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    except Exception:
        return None
    raw, name = props.get("uuid"), props.get("name", b"GPU")
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        return f"GPU-{uuid.UUID(bytes=bytes(raw))}", name
    return (str(raw) if raw else f"GPU-{name}-pci{props.get('pciBusID', 0)}"), name
