"""The CuPy stand-in: streams are not in order for free, never-written memory is loud, capture
rules hold, and what it does not implement fails at once with the name of the call."""
import gc

import numpy as np
import pytest

from freetoken.cuda_emu import memory


def test_missing_wait_on_the_copy_stream_is_caught(cp):
    """The fill pattern of the MoE runtime in miniature: an async host->device copy on the copy
    stream, then compute on the current stream. Without the event wait the compute is not
    ordered after the copy (on a busy GPU it reads stale bytes): the hazard check refuses it
    when it is queued, naming both operations and where each was queued; with it, the copied
    values."""
    from freetoken.cuda_emu.hazards import HazardError
    from freetoken.moe.device import CudaDevice
    dev = CudaDevice()
    src = dev.pinned((4,), np.float32)
    src[:] = 3.0

    def run(wait: bool):
        dst = cp.empty(4, cp.float32)
        filled = dev.event()
        with dev.copy_stream():
            dev.h2d(dst, src)
        dev.record(filled, on_copy=True)
        if wait:
            dev.wait(filled)
        return (dst * 2).get()

    with pytest.raises(HazardError, match=r"\(read after write\) on bytes \[0, 16\) .*test_standin.py:\d+ "
                                          r"\(run\), is not ordered after cudaMemcpyAsync\(16 bytes\) on stream "
                                          r"0x[0-9a-f]+, queued at .*moe/device.py"):
        run(wait=False)
    assert run(wait=True).tolist() == [6.0] * 4


def test_zeroing_on_one_stream_and_filling_from_another_is_a_hazard(cp):
    """cp.zeros is work on the current stream: a copy stream that writes the array without
    waiting for it races with the zeroing (write after write)."""
    from freetoken.cuda_emu.hazards import HazardError
    from freetoken.moe.device import CudaDevice
    dev = CudaDevice()
    src = dev.pinned((4,), np.float32)
    dst = cp.zeros(4, cp.float32)
    with pytest.raises(HazardError, match=r"write after write"):
        with dev.copy_stream():
            dev.h2d(dst, src)
    dst2 = cp.zeros(4, cp.float32)
    cp.cuda.Device().synchronize()
    with dev.copy_stream():
        dev.h2d(dst2, src)                  # after a host synchronisation: ordered
    cp.cuda.Device().synchronize()          # before dst2 and src go away


def test_host_reads_a_d2h_copy_only_after_the_sync(cp):
    from freetoken.moe.device import CudaDevice
    dev = CudaDevice()
    x = cp.full(3, 5.0, cp.float32)
    host = dev.pinned((3,), np.float32)
    host[:] = -1
    done = dev.event()
    dev.d2h(host, x)
    dev.record(done)
    assert host.tolist() == [-1.0] * 3                    # nothing forced the stream yet
    dev.synchronize(done)
    assert host.tolist() == [5.0] * 3


def test_never_written_memory_is_reported_on_read_back(cp):
    a = cp.empty((2, 3), cp.float32)
    a[0] = 1.0
    with pytest.raises(RuntimeError, match=r"3 of 6 elements were never written.*test_standin.py"):
        a.get()
    assert a[0].get().tolist() == [1.0] * 3


def test_capture_rejects_host_sync_allocation_and_pageable_copies(cp):
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(4, cp.float32)
    with s:
        s.begin_capture()
        x += 1
        with pytest.raises(memory.CaptureError, match="host synchronisation during graph capture"):
            x.get()
        with pytest.raises(memory.CaptureError, match="allocation of 16 bytes.*outside a private"):
            cp.empty(4, cp.float32)
        with pytest.raises(memory.CaptureError, match="pageable"):
            x.set(np.ones(4, np.float32))
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc):
            y = x * 3                                      # a private pool: legal
        graph = s.end_capture()
    assert x.get().tolist() == [0.0] * 4                  # capture records, it does not run
    graph.launch(s)
    graph.launch(s)
    s.synchronize()
    assert x.get().tolist() == [2.0] * 4 and y.get().tolist() == [6.0] * 4


def test_device_size_is_configurable_and_exhaustion_raises(cp, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CUDA_EMULATE_MEMORY", "64M")
    gc.collect()                                           # earlier tests' garbage is freed now
    free, total = cp.cuda.runtime.memGetInfo()
    assert total == 64 << 20 and free <= total
    keep = cp.empty(16 << 20, cp.uint8)
    assert cp.cuda.runtime.memGetInfo()[0] <= free - (16 << 20)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError, match="emulated device"):
        cp.empty(60 << 20, cp.uint8)
    del keep


def test_unimplemented_calls_fail_with_their_name(cp):
    with pytest.raises(AttributeError, match=r"cupy\.fft"):
        cp.fft
    with pytest.raises(AttributeError, match=r"cupy\.cuda\.texture"):
        cp.cuda.texture
    with pytest.raises(AttributeError, match=r"\.searchsorted"):
        cp.zeros(3).searchsorted


def test_host_arrays_do_not_mix_into_device_math(cp):
    a = cp.zeros(3, cp.float32)
    with pytest.raises(TypeError, match="host numpy array"):
        a + np.ones(3, np.float32)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)


def test_views_share_memory_and_gathers_copy(cp):
    a = cp.asarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    row = a[1]
    row[...] = 0                                           # a view: writes through
    idx = cp.asarray(np.array([2, 0], np.int32))
    picked = a[idx]
    a[2] = -5
    assert picked.get().tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]   # ran before the write
    assert a.get()[1].tolist() == [0, 0, 0, 0]
    assert int(a.sum()) == sum([0, 1, 2, 3, -20])


DOUBLE = r"""
extern "C" __global__ void double_it(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"""


def test_a_kernel_reading_never_written_memory_is_named(cp):
    from freetoken.cuda_emu.device_code import EmuFault
    kern = cp.RawModule(code=DOUBLE).get_function("double_it")
    x, y = cp.empty(64, cp.float32), cp.zeros(64, cp.float32)
    x[:32] = 1.0                                           # the second half is never written
    kern((1,), (32,), (x, y, np.int32(32)))
    assert y[:32].get().tolist() == [2.0] * 32             # what was written reads fine
    kern((2,), (32,), (x, y, np.int32(64)))
    with pytest.raises(EmuFault, match=r"double_it: wrote NaN into 32 elements of `y` while its "
                                       r"input `x` holds 32 never-written words"):
        y.get()


def test_an_out_of_bounds_read_names_the_allocation(cp):
    from freetoken.cuda_emu.device_code import EmuFault
    kern = cp.RawModule(code=DOUBLE).get_function("double_it")
    x, y = cp.zeros(8, cp.float32), cp.zeros(4096, cp.float32)
    kern((16,), (256,), (x, y, np.int32(4096)))            # reads x far past its 8 floats
    with pytest.raises(EmuFault, match=r"double_it.*32-byte device allocation \(float32\[8\] "
                                       r"allocated at test_standin.py"):
        cp.cuda.Device().synchronize()


def test_a_bad_launch_shape_fails_at_the_launch_as_on_a_device(cp):
    """CUDA refuses a zero grid (or a block over the limits) when the launch is made, not at a
    later synchronize; so does the emulated RawKernel, and nothing is enqueued or counted."""
    from freetoken.cuda_emu import kernels
    from freetoken.cuda_emu.device_code import EmuFault
    kern = cp.RawModule(code=DOUBLE).get_function("double_it")
    x, y = cp.zeros(8, cp.float32), cp.zeros(8, cp.float32)
    before = kernels.launches
    with pytest.raises(EmuFault, match="zero or negative dimension"):
        kern((0,), (32,), (x, y, np.int32(0)))
    with pytest.raises(EmuFault, match="exceeds the device limits"):
        kern((1,), (2048,), (x, y, np.int32(8)))
    assert kernels.launches == before


def test_an_array_dropped_after_its_copy_was_queued_stays_until_the_copy_ran(cp):
    """CuPy's pool frees in stream order, so dropping an array right after queuing its last use
    is legal; the queued copy keeps the emulated block (it once ran on unmapped memory)."""
    from freetoken.moe.device import CudaDevice
    dev = CudaDevice()
    host = dev.pinned((1000,), np.float32)
    x = cp.full(1000, 3.0, cp.float32)
    dev.d2h(host, x)
    del x
    gc.collect()
    cp.cuda.Device().synchronize()
    assert (host == 3.0).all()


def test_a_host_view_keeps_its_allocation(cp):
    """A numpy view of device memory (what a failing test's traceback prints) outlives the
    array it came from without reading unmapped pages."""
    from freetoken.cuda_emu import memory
    x = cp.full(5000, 2.0, cp.float32)
    cp.cuda.Device().synchronize()
    view = memory.host_view(x.data.ptr, x.nbytes).view(np.float32)
    del x
    gc.collect()
    assert repr(view).startswith("array([2., 2.")
