"""Race mode of the emulated device (FREETOKEN_CUDA_EMULATE_RACES=1, emu/race.cpp): two threads'
accesses to one shared byte, one a write, with nothing ordering them fail the launch, naming
both accesses' file:line; the orderings CUDA gives (__syncthreads; within a warp, a warp
operation) and atomics are not races."""
import numpy as np
import pytest

from freetoken.cuda_emu import device_code as dc
from tests.cuda_emu.test_device_code import BLOCK_SUM, from_device, kernel, to_device


@pytest.fixture(autouse=True)
def race_mode(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CUDA_EMULATE_RACES", "1")


def _sum(k, n=512, block=256, shared_mem=0):
    x = np.arange(n, dtype=np.float32)
    px, po = to_device(x), dc.alloc(8 * (n // block))
    k.launch((n // block, 1, 1), (block, 1, 1), shared_mem, [px, po, np.int32(n)])
    return from_device(po, n // block, np.float32), x.reshape(-1, block).sum(1)


def test_a_correct_reduction_is_not_a_race():
    got, want = _sum(kernel(BLOCK_SUM, "block_sum_f32"))
    np.testing.assert_array_equal(got, want)


# common.cuh's block_sum shape, twice in a row, without the trailing __syncthreads: warp 0's
# lane 0 writes scratch[0] for the second sum while other warps still read the first.
TWO_SUMS = r'''
__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) r += scratch[w];
  TRAILING_BARRIER
  return r;
}
extern "C" __global__ void two_sums_f32(const float* x, float* out, int n) {
  __shared__ float scratch[32];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = i < n ? x[i] : 0.f;
  const float a = block_sum(v, scratch);
  const float b = block_sum(2.f * v, scratch);
  if (threadIdx.x == 0) { out[2 * blockIdx.x] = a; out[2 * blockIdx.x + 1] = b; }
}'''


def test_a_missing_trailing_barrier_is_a_race_naming_both_lines():
    good = kernel(TWO_SUMS.replace("TRAILING_BARRIER", "__syncthreads();"), "two_sums_f32")
    x = np.arange(256, dtype=np.float32)
    px, po = to_device(x), dc.alloc(8)
    good.launch((1, 1, 1), (256, 1, 1), 0, [px, po, np.int32(256)])
    np.testing.assert_array_equal(from_device(po, 2, np.float32), [x.sum(), 2 * x.sum()])
    bad = kernel(TWO_SUMS.replace("TRAILING_BARRIER", ""), "two_sums_f32")
    with pytest.raises(dc.EmuFault, match=r"shared-memory race") as e:
        bad.launch((1, 1, 1), (256, 1, 1), 0, [px, po, np.int32(256)])
    text = str(e.value)
    assert "static shared memory" in text and "no __syncthreads between" in text
    assert "read it at /emu_test/two_sums_f32.cu:11 (block_sum" in text    # the first sum's read
    assert "writes it at /emu_test/two_sums_f32.cu:8 (block_sum" in text   # the second's write


WARP_SCAN = r'''
extern "C" __global__ void warp_shift_f32(const float* x, float* out, int sync) {
  extern __shared__ float s[];
  const int t = threadIdx.x;
  s[t] = x[t];
  if (sync) __syncwarp();
  out[t] = s[(t + 1) % 32];
}'''


def test_within_a_warp_a_warp_operation_orders_and_its_absence_races():
    k = kernel(WARP_SCAN, "warp_shift_f32")
    x = np.arange(32, dtype=np.float32)
    px, po = to_device(x), dc.alloc(128)
    k.launch((1, 1, 1), (32, 1, 1), 128, [px, po, np.int32(1)])
    np.testing.assert_array_equal(from_device(po, 32, np.float32), np.roll(x, -1))
    with pytest.raises(dc.EmuFault, match=r"race \(write after read\) on byte 4 of dynamic shared "
                                          r"memory: thread \(0,0,0\) read it at /emu_test/warp_shift_f32.cu:7 "
                                          r".*writes it at /emu_test/warp_shift_f32.cu:5"):
        k.launch((1, 1, 1), (32, 1, 1), 128, [px, po, np.int32(0)])


COUNT = r'''
extern "C" __global__ void count_i32(int* out) {
  __shared__ int n;
  if (threadIdx.x == 0) n = 0;
  __syncthreads();
  atomicAdd(&n, 1);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = n;
}'''


def test_atomics_on_one_shared_word_are_not_races():
    po = dc.alloc(4)
    kernel(COUNT, "count_i32").launch((2, 1, 1), (128, 1, 1), 0, [po])
    assert from_device(po, 1, np.int32)[0] == 128


def test_race_mode_builds_apart():
    """The instrumented build is its own cache entry: the plain one still runs uninstrumented."""
    assert dc.races()
    instrumented = kernel(BLOCK_SUM, "block_sum_f32")
    import os
    del os.environ["FREETOKEN_CUDA_EMULATE_RACES"]
    assert kernel(BLOCK_SUM, "block_sum_f32") is not instrumented


ORDER = r'''
extern "C" __global__ void order_i32(int* threads, int* blocks, int* next_block) {
  __shared__ int n;
  if (threadIdx.x == 0) n = 0;
  __syncthreads();
  const int at = atomicAdd(&n, 1);
  if (blockIdx.x == 0) threads[at] = threadIdx.x;
  if (threadIdx.x == 0) blocks[atomicAdd(next_block, 1)] = blockIdx.x;
}'''


def _order(seed):
    dc.set_fuzz(seed)
    try:
        threads, blocks, nxt = dc.alloc(4 * 64), dc.alloc(4 * 16), to_device(np.zeros(1, np.int32))
        kernel(ORDER, "order_i32").launch((16, 1, 1), (64, 1, 1), 0, [threads, blocks, nxt])
        return from_device(threads, 64, np.int32), from_device(blocks, 16, np.int32)
    finally:
        dc.set_fuzz(dc.fuzz_seed())


def test_schedule_fuzz_runs_threads_and_blocks_in_other_orders():
    """Unfuzzed, threads reach the atomic in thread order and blocks run in order; fuzzed, each
    is a permutation that differs from that (and between seeds), as a GPU may pick."""
    threads, blocks = _order(0)
    np.testing.assert_array_equal(threads, np.arange(64))
    np.testing.assert_array_equal(blocks, np.arange(16))
    t1, b1 = _order(1)
    t2, b2 = _order(2)
    for got, n in ((t1, 64), (t2, 64), (b1, 16), (b2, 16)):
        assert sorted(got) == list(range(n)) and list(got) != list(range(n))
    assert list(t1) != list(t2) and list(b1) != list(b2)


def test_fuzz_seed_must_be_an_integer(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CUDA_EMULATE_FUZZ", "yes")
    with pytest.raises(ValueError, match="non-negative integer seed"):
        dc.fuzz_seed()
