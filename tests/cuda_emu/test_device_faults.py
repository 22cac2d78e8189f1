"""Faults of emulated kernels (freetoken/cuda_emu/device_code.py) are loud: each raises EmuFault
naming the kernel, and the runtime stays usable for the next launch."""
import numpy as np
import pytest

from freetoken.cuda_emu import device_code as dc
from tests.cuda_emu.test_device_code import BLOCK_SUM, from_device, kernel, to_device


def assert_still_usable():
    """A good kernel computes the right sum after whatever faulted before."""
    x = np.ones(512, np.float32)
    px, po = to_device(x), dc.alloc(8)
    kernel(BLOCK_SUM, "block_sum_f32").launch((2, 1, 1), (256, 1, 1), 0, [px, po, np.int32(512)])
    assert list(from_device(po, 2, np.float32)) == [256.0, 256.0]


def fault(k, grid, block, shared_mem, args, match):
    with pytest.raises(dc.EmuFault, match=match) as e:
        k.launch(grid, block, shared_mem, args)
    assert e.value.kernel == k.name and str(e.value).startswith(f"kernel {k.name}: ")
    assert_still_usable()
    return e.value


COPY = r'''
extern "C" __global__ void copy_f32(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}'''


def test_global_read_past_an_allocation_faults_with_its_address():
    k = kernel(COPY, "copy_f32")
    x, y = dc.alloc(100 * 4), dc.alloc(200 * 4)
    e = fault(k, (1, 1, 1), (256, 1, 1), 0, [x, y, np.int32(200)],
              r"invalid memory access .*past the end .*of the 400-byte allocation")
    assert x + 400 <= e.address < x + 400 + 4096
    assert "block (0,0,0), thread (" in str(e)


STATIC_OOB = r'''
extern "C" __global__ void static_oob_f32(float* out, int n) {
  __shared__ float s[64];
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = 1.f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}'''


def test_static_shared_write_out_of_bounds_names_the_line_and_index():
    k = kernel(STATIC_OOB, "static_oob_f32")
    out = dc.alloc(64 * 4)
    k.launch((1, 1, 1), (64, 1, 1), 0, [out, np.int32(64)])
    fault(k, (1, 1, 1), (64, 1, 1), 0, [out, np.int32(65)],
          r"array index 64 out of bounds for type 'float \[64\]' at /emu_test/static_oob_f32.cu:4")


DYN_OOB = r'''
extern "C" __global__ void dyn_oob_f32(float* out, int n) {
  extern __shared__ float buf[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = 2.f;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}'''


def test_dynamic_shared_overrun_faults():
    k = kernel(DYN_OOB, "dyn_oob_f32")
    out = dc.alloc(32 * 4)
    k.launch((1, 1, 1), (32, 1, 1), 4096, [out, np.int32(1024)])
    fault(k, (1, 1, 1), (32, 1, 1), 4096, [out, np.int32(1100)],
          r"dynamic shared memory out of bounds: byte 4096 of a 4096-byte buffer")
    # within the 16-byte rounding of the buffer's end: caught when the block ends
    fault(k, (1, 1, 1), (32, 1, 1), 1000, [out, np.int32(251)],
          r"wrote past the end of its 1000-byte dynamic shared memory")


def test_launch_shapes_the_device_rejects():
    k = kernel(COPY, "copy_f32")
    x = dc.alloc(4096)
    args = [x, x, np.int32(0)]
    fault(k, (1, 1, 1), (1025, 1, 1), 0, args, r"block \(1025, 1, 1\) \(1025 threads\) exceeds")
    fault(k, (1, 1, 1), (32, 32, 2), 0, args, r"2048 threads")
    fault(k, (0, 1, 1), (32, 1, 1), 0, args, r"zero or negative dimension")
    fault(k, (1, 70000, 1), (32, 1, 1), 0, args, r"grid .* exceeds the device limits")


def test_dynamic_shared_over_48k_needs_the_opt_in():
    k = kernel(DYN_OOB, "dyn_oob_f32")
    out = dc.alloc(32 * 4)
    args = [out, np.int32(16384)]
    fault(k, (1, 1, 1), (32, 1, 1), 65536, args, r"65536 bytes of dynamic shared memory")
    k.max_dynamic_shared_size_bytes = 65536
    k.launch((1, 1, 1), (32, 1, 1), 65536, args)
    assert (from_device(out, 32, np.float32) == 2.0).all()
    fault(k, (1, 1, 1), (32, 1, 1), 65540, args, r"the limit is 65536")
    with pytest.raises(ValueError, match="opt-in maximum"):
        k.max_dynamic_shared_size_bytes = 228 * 1024
    k.max_dynamic_shared_size_bytes = 0


DIVERGENT = r'''
extern "C" __global__ void divergent_f32(float* out, int mode) {
  __shared__ float s[128];
  s[threadIdx.x] = 1.f;
  if (mode == 0 && threadIdx.x >= 64) return;          // exits before the barrier
  if (mode == 1 && threadIdx.x < 64) {
    __syncthreads();                                    // another barrier than the rest
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = s[127 - threadIdx.x];
}'''


@pytest.mark.parametrize("mode, match", [
    (0, r"barrier divergence: 64 thread\(s\) wait at __syncthreads \(/emu_test/divergent_f32.cu:"
        r"9\) that 64 thread\(s\) exited"),
    (1, r"barrier divergence: __syncthreads at /emu_test/divergent_f32.cu:9 while 64 thread"),
])
def test_divergent_syncthreads_faults_instead_of_hanging(mode, match):
    k = kernel(DIVERGENT, "divergent_f32")
    out = dc.alloc(128 * 4)
    fault(k, (2, 1, 1), (128, 1, 1), 0, [out, np.int32(mode)], match)
    k.launch((2, 1, 1), (128, 1, 1), 0, [out, np.int32(2)])
    assert (from_device(out, 128, np.float32) == 1.0).all()


WARP_EXIT = r'''
extern "C" __global__ void warp_exit_f32(float* out, int mode) {
  const int lane = threadIdx.x & 31;
  if (mode == 0 && lane == 7) return;                   // the mask still names it
  if (mode == 1 && lane < 16) { out[lane] = __shfl_sync(0xffffu, 1.f, 0); return; }
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)lane, 1);
}'''


@pytest.mark.parametrize("mode, match", [
    (0, r"(names lanes 0x00000080 that have exited|lane 7 exited while lane \d+ waits)"),
    (1, r"__shfl_xor_sync mask 0xffffffff names lanes 0x[0-9a-f]{8} that have exited"),
])
def test_warp_operation_naming_an_exited_lane_faults(mode, match):
    fault(kernel(WARP_EXIT, "warp_exit_f32"), (1, 1, 1), (32, 1, 1), 0,
          [dc.alloc(128), np.int32(mode)], match)


UNWRITTEN = r'''
extern "C" __global__ void unwritten_f32(float* out) {
  __shared__ float s[64];
  extern __shared__ float d[];
  if (threadIdx.x < (blockIdx.x == 0 ? 64 : 32)) s[threadIdx.x] = 1.f, d[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x] + d[threadIdx.x];
}'''


def test_shared_memory_never_written_reads_as_nan_in_every_block():
    """Block 0 writes all of both buffers, later blocks half: each block starts poisoned."""
    k = kernel(UNWRITTEN, "unwritten_f32")
    out = dc.alloc(64 * 4)
    k.launch((3, 1, 1), (64, 1, 1), 256, [out])
    got = from_device(out, 64, np.float32)
    assert (got[:32] == 2.0).all() and np.isnan(got[32:]).all()


SHIFTED = r'''
extern "C" __global__ void shifted_f32(float* y, int at) {
  if (threadIdx.x == 0) y[at] = 1.f;
}'''


@pytest.mark.parametrize("at,match", [
    (100, r"0 bytes past the end \(byte offset 400\) of the 400-byte allocation"),
    (127, r"108 bytes past the end \(byte offset 508\) of the 400-byte allocation"),
    (-1, r"4 bytes before the start of the 400-byte allocation"),
    (-64, r"256 bytes before the start of the 400-byte allocation")])
def test_writes_into_an_allocations_slack_fault_after_the_launch(at, match):
    """The alignment padding past the end and the bytes just before the start are mapped, so no
    guard page sees a write there; the poison checked after the launch does, naming the
    parameter (the lowest byte written: the most negative index, the first past the end)."""
    k = kernel(SHIFTED, "shifted_f32")
    y = dc.alloc(400)
    fault(k, (1, 1, 1), (32, 1, 1), 0, [y, np.int32(at)], r"parameter y points into: " + match)
    k.launch((1, 1, 1), (32, 1, 1), 0, [y, np.int32(99)])       # reported once, then clean


DYN_NEG = r'''
extern "C" __global__ void dyn_neg_f32(float* out, int at) {
  extern __shared__ float buf[];
  if (threadIdx.x == 0) buf[at] = 3.f;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = at >= 0 ? buf[at] : 0.f;
}'''


def test_dynamic_shared_write_at_a_negative_index_faults():
    """router.cu once wrote smem_p[-1]: a write just before the dynamic buffer is caught when
    the block ends."""
    k = kernel(DYN_NEG, "dyn_neg_f32")
    out = dc.alloc(4)
    k.launch((1, 1, 1), (32, 1, 1), 1024, [out, np.int32(0)])
    fault(k, (1, 1, 1), (32, 1, 1), 1024, [out, np.int32(-1)],
          r"wrote 4 bytes before the start of its 1024-byte dynamic shared memory")
    fault(k, (1, 1, 1), (32, 1, 1), 1024, [out, np.int32(-64)],
          r"wrote 256 bytes before the start")


VEC_LOAD = r'''
extern "C" __global__ void vec_load_f32(const float* x, float* out, int at) {
  const float4 v = *reinterpret_cast<const float4*>(x + at);
  if (threadIdx.x == 0) out[0] = v.x + v.y + v.z + v.w;
}'''


def test_a_misaligned_vector_load_faults_naming_the_line():
    """A float4 load 4 bytes off a 16-byte boundary: a real GPU faults (misaligned address)."""
    k = kernel(VEC_LOAD, "vec_load_f32")
    x, out = to_device(np.arange(16, dtype=np.float32)), dc.alloc(4)
    k.launch((1, 1, 1), (32, 1, 1), 0, [x, out, np.int32(4)])
    assert from_device(out, 1, np.float32)[0] == 4 + 5 + 6 + 7
    fault(k, (1, 1, 1), (32, 1, 1), 0, [x, out, np.int32(1)],
          r"misaligned address 0x[0-9a-f]+ for type 'const struct float4', which needs 16-byte "
          r"alignment, at /emu_test/vec_load_f32.cu:3")
