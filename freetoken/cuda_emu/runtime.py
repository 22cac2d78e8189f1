"""cupy.cuda.runtime and cupy.cuda.Device of the emulated device: one device of
FREETOKEN_CUDA_EMULATE_MEMORY bytes (default 2 GiB) that reports H100-like limits, raw
cudaMemcpyAsync between host and device addresses, and host memory registration."""
from __future__ import annotations

import ctypes

import numpy as np

from freetoken.cuda_emu import memory
from freetoken.cuda_emu.streams import stream_by_ptr, synchronize_all

memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = range(5)
hostRegisterDefault, hostRegisterPortable, hostRegisterMapped = 0, 1, 2
SHARED_PER_BLOCK, SHARED_OPTIN = 48 << 10, 227 << 10
# cudaDeviceAttr numbers the project asks for (the CUDA runtime's enum values)
cudaDevAttrMaxThreadsPerBlock = 1
cudaDevAttrMaxSharedMemoryPerBlock = 8
cudaDevAttrClockRate = 13
cudaDevAttrMultiProcessorCount = 16
cudaDevAttrMemoryClockRate = 36
cudaDevAttrGlobalMemoryBusWidth = 37
cudaDevAttrComputeCapabilityMajor = 75
cudaDevAttrComputeCapabilityMinor = 76
cudaDevAttrCanUseHostPointerForRegisteredMem = 91
cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
_ATTRS = {1: 1024, 8: SHARED_PER_BLOCK, 13: 1_980_000, 16: 132, 36: 2_619_000, 37: 5120, 75: 9,
          76: 0, 91: 1, 97: SHARED_OPTIN}
EMULATED_UUID = bytes(range(0xE0, 0xF0))


class CUDARuntimeError(RuntimeError):
    """cupy_backends.cuda.api.runtime.CUDARuntimeError."""


def getDeviceCount() -> int:
    return 1


def memGetInfo() -> tuple[int, int]:
    total = memory.device_bytes()
    return max(total - memory.DEVICE.used, 0), total


def getDeviceProperties(device: int) -> dict:
    _check_device(device)
    return {"name": b"FreeToken emulated CUDA device", "uuid": EMULATED_UUID, "pciBusID": 0,
            "totalGlobalMem": memory.device_bytes(), "sharedMemPerBlock": SHARED_PER_BLOCK,
            "sharedMemPerBlockOptin": SHARED_OPTIN, "maxThreadsPerBlock": 1024, "warpSize": 32,
            "multiProcessorCount": _ATTRS[16], "major": 9, "minor": 0,
            "clockRate": _ATTRS[13], "memoryClockRate": _ATTRS[36], "memoryBusWidth": _ATTRS[37]}


def deviceGetAttribute(attr: int, device: int) -> int:
    _check_device(device)
    try:
        return _ATTRS[int(attr)]
    except KeyError:
        raise NotImplementedError(f"emulated CUDA runtime: deviceGetAttribute({attr}) is not modelled")


def _check_device(device: int) -> None:
    if int(device) != 0:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {device} (the emulator has one)")


def hostRegister(ptr: int, size: int, flags: int) -> None:
    memory.host_register(int(ptr), int(size), flags)


def hostUnregister(ptr: int) -> None:
    memory.host_unregister(int(ptr))


def deviceSynchronize() -> None:
    synchronize_all("cudaDeviceSynchronize()")


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """Raw copy enqueued on the stream with handle `stream`. A pageable host source is read now
    (the driver stages it before returning); device and pinned memory are read when it runs."""
    dst, src, size = int(dst), int(src), int(size)
    s = stream_by_ptr(stream)
    from_device = memory.DEVICE.find(src) is not None
    pageable = not from_device and not memory.is_pinned(src)
    if pageable and s.is_capturing():
        raise memory.CaptureError("cudaMemcpyAsync from pageable host memory during graph capture")
    snapshot = memory.host_view(src, size).copy() if pageable else None
    to_host = memory.DEVICE.find(dst) is None

    def run():
        data = snapshot if snapshot is not None else memory.host_view(src, size)
        if from_device and to_host:
            _check_d2h(src, data)
        ctypes.memmove(dst, data.ctypes.data, size)
    s.enqueue(run, f"cudaMemcpyAsync({size} bytes)", [(dst, dst + size, True), (src, src + size, False)])


def memcpy(dst: int, src: int, size: int, kind: int) -> None:
    memcpyAsync(dst, src, size, kind, 0)
    synchronize_all("cudaMemcpy()")


def _check_d2h(src: int, data: np.ndarray) -> None:
    alloc = memory.DEVICE.find(src)[2]
    width = getattr(alloc, "itemsize", 4)
    if width in memory.POISON_WORDS and data.size % width == 0 and src % width == 0:
        memory.check_written(data.view(memory._UINT[width]), "device-to-host cudaMemcpyAsync", alloc.site)


class Device:
    """cupy.cuda.Device: the one emulated device."""

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        _check_device(self.id)

    def synchronize(self) -> None:
        synchronize_all("Device().synchronize()")

    def use(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def compute_capability(self) -> str:
        return "90"

    @property
    def mem_info(self) -> tuple[int, int]:
        return memGetInfo()

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

