"""The emulated device's kernel side (freetoken/cuda_emu/device_code.py): small kernels built from
strings run with CUDA's semantics (barriers, warp operations, shared memory, atomics), device
allocations are guard-paged and poisoned, every real cuda/*.cu builds, and one real kernel
computes its reference's numbers. The faults are in test_device_faults.py."""
import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from freetoken.cuda_emu import device_code as dc
from freetoken.kernels import _cuda, rms_norm


def to_device(a: np.ndarray) -> int:
    p = dc.alloc(a.nbytes)
    ctypes.memmove(p, a.ctypes.data, a.nbytes)
    return p


def from_device(p: int, shape, dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    ctypes.memmove(out.ctypes.data, p, out.nbytes)
    return out


def kernel(body: str, name: str, options=()):
    return dc.build(f'#line 1 "/emu_test/{name}.cu"\n{body}', tuple(options)).get_function(name)


BLOCK_SUM = r'''
extern "C" __global__ void block_sum_f32(const float* x, float* out, int n) {
  __shared__ float s[256];
  const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  s[t] = i < n ? x[i] : 0.f;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (t < o) s[t] += s[t + o];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}'''


def test_block_sum_barriers_across_256_threads_and_4_blocks():
    k = kernel(BLOCK_SUM, "block_sum_f32")
    assert k.name == "block_sum_f32"
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    px, po = to_device(x), dc.alloc(16)
    k.launch((4, 1, 1), (256, 1, 1), 0, [px, po, np.int32(1000)])
    want = np.pad(x, (0, 24)).reshape(4, 256).sum(1)
    np.testing.assert_allclose(from_device(po, 4, np.float32), want, rtol=1e-5, atol=1e-5)
    dc.free(px), dc.free(po)


WARP = r'''
extern "C" __global__ void warp_ops_i32(int* out) {
  const int lane = threadIdx.x & 31, t = threadIdx.x;
  int* o = out + t * 8;
  o[0] = __shfl_sync(0xffffffffu, lane * 10, 3);          // every lane gets lane 3's
  o[1] = __shfl_xor_sync(0xffffffffu, lane, 5);
  o[2] = __shfl_down_sync(0xffffffffu, lane, 4);          // past the end: its own value
  o[3] = __shfl_up_sync(0xffffffffu, lane, 1, 8);         // segments of 8
  o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  o[5] = __any_sync(0xffffffffu, lane == 17) + 2 * __all_sync(0xffffffffu, lane < 32);
  int v = lane;
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  o[6] = v;
  __syncwarp();
  if (lane >= 20) return;
  o[7] = (int)__activemask();                             // the lanes that did not return
}'''


def test_warp_shuffles_and_votes():
    k = kernel(WARP, "warp_ops_i32")
    po = dc.alloc(64 * 8 * 4)
    k.launch((1, 1, 1), (64, 1, 1), 0, [po])
    got = from_device(po, (64, 8), np.int32)
    lane = np.arange(64) % 32
    ballot = sum(1 << i for i in range(32) if i % 3 == 0)
    np.testing.assert_array_equal(got[:, 0], 30)
    np.testing.assert_array_equal(got[:, 1], lane ^ 5)
    np.testing.assert_array_equal(got[:, 2], np.where(lane + 4 < 32, lane + 4, lane))
    np.testing.assert_array_equal(got[:, 3], np.where(lane % 8 >= 1, lane - 1, lane))
    np.testing.assert_array_equal(got[:, 4], np.int32(np.uint32(ballot)))
    np.testing.assert_array_equal(got[:, 5], 3)
    np.testing.assert_array_equal(got[:, 6], sum(range(32)))
    np.testing.assert_array_equal(got[lane < 20, 7], 0xFFFFF)


DYNAMIC = r'''
extern "C" __global__ void reverse_f32(const float* x, float* y, int n) {
  extern __shared__ __align__(16) float buf[];
  const int t = threadIdx.x, base = blockIdx.x * n;
  for (int i = t; i < n; i += blockDim.x) buf[i] = x[base + i];
  __syncthreads();
  for (int i = t; i < n; i += blockDim.x) y[base + i] = buf[n - 1 - i];
}'''


def test_dynamic_shared_memory_is_the_launch_size_per_block():
    k = kernel(DYNAMIC, "reverse_f32")
    n = 3000                                  # 12000 bytes, not a multiple of the block
    x = np.arange(2 * n, dtype=np.float32)
    px, py = to_device(x), dc.alloc(x.nbytes)
    k.launch((2, 1, 1), (128, 1, 1), n * 4, [px, py, np.int32(n)])
    np.testing.assert_array_equal(from_device(py, (2, n), np.float32), x.reshape(2, n)[:, ::-1])


ATOMICS = r'''
extern "C" __global__ void atomics_i32(int* c, float* f, unsigned long long* u, long long* m) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&c[0], 1);
  atomicSub(&c[1], 2);
  atomicMax(&c[2], t);
  atomicMin(&c[3], -t);
  atomicOr(&c[4], 1 << (t % 31));
  atomicAnd(&c[5], ~(1 << (t % 7)));
  atomicCAS(&c[6], t - 1, t);               // only the chain 0 -> 1 -> ... in launch order
  atomicExch(&c[7], 42);
  atomicAdd(f, 0.5f);
  atomicAdd(u, 3ull);
  atomicMax(m, (long long)t << 33);
}'''


def test_atomics_from_many_blocks():
    k = kernel(ATOMICS, "atomics_i32")
    c = to_device(np.array([0, 0, -1, 0, 0, -1, -1, 0], np.int32))
    f, u, m = to_device(np.zeros(1, np.float32)), to_device(np.zeros(1, np.uint64)), \
        to_device(np.zeros(1, np.int64))
    k.launch((37, 1, 1), (96, 1, 1), 0, [c, f, u, m])
    n = 37 * 96
    got = from_device(c, 8, np.int32)
    assert list(got[:4]) == [n, -2 * n, n - 1, -(n - 1)]
    assert got[4] == 0x7FFFFFFF and got[5] == -1 & ~0x7F and got[6] == n - 1 and got[7] == 42
    assert from_device(f, 1, np.float32)[0] == n / 2
    assert from_device(u, 1, np.uint64)[0] == 3 * n
    assert from_device(m, 1, np.int64)[0] == (n - 1) << 33


SUBNORMALS = r"""
extern "C" __global__ void subnormals_f32(const float* x, float* out) {
  out[threadIdx.x] = __fmul_rn(x[threadIdx.x], x[4]);  // x[4] = 1: a product g++ cannot fold
}
"""


def test_f32_subnormals_are_zero_in_a_kernel_and_kept_on_the_host():
    """-ftz=true, as CuPy builds every kernel: a subnormal input is zero, a normal one stays; the
    launching thread's own arithmetic (numpy) keeps its subnormals after the launch."""
    k = kernel(SUBNORMALS, "subnormals_f32")
    tiny = np.array([1e-40, -3e-39, 1.2e-38, 2.0, 1.0], np.float32)
    x, out = to_device(tiny), to_device(np.full(4, 7.0, np.float32))
    k.launch((1, 1, 1), (4, 1, 1), 0, [x, out])
    assert list(from_device(out, 4, np.float32)) == [0.0, 0.0, np.float32(1.2e-38), 2.0]
    assert tiny[0] * np.float32(1.0) != 0 and np.float32(1e-38) / np.float32(4) != 0


def test_alloc_is_aligned_poisoned_and_ends_at_a_guard_page():
    for nbytes in (0, 1, 100, 256, 4096, 5000):
        p = dc.alloc(nbytes)
        assert p % 256 == 0
        page_end = (p + nbytes + 4095) // 4096 * 4096
        assert 0 <= page_end - (p + nbytes) < 256 or nbytes == 0
        words = from_device(p, nbytes // 2, np.uint16)
        assert (words == dc.POISON16).all()
        assert np.isnan(from_device(p, nbytes // 4, np.float32)).all()
        dc.free(p)
    with pytest.raises(ValueError, match="not the start"):
        dc.free(12345)


def test_arguments_are_checked_against_the_signature():
    k = kernel(BLOCK_SUM, "block_sum_f32")
    p = dc.alloc(64)
    with pytest.raises(TypeError, match="block_sum_f32.*2 arguments for 3"):
        k.launch((1, 1, 1), (32, 1, 1), 0, [p, p])
    with pytest.raises(TypeError, match="block_sum_f32: parameter n .*numpy.int32, not int"):
        k.launch((1, 1, 1), (32, 1, 1), 0, [p, p, 5])
    with pytest.raises(TypeError, match="parameter x .*device address"):
        k.launch((1, 1, 1), (32, 1, 1), 0, [1.5, p, np.int32(5)])
    with pytest.raises(KeyError, match="block_sum_f64.*block_sum_f32"):
        dc.build(f'#line 1 "/emu_test/block_sum_f32.cu"\n{BLOCK_SUM}', ()).get_function("block_sum_f64")


def _build(path):
    d = _cuda.cuda_dir()
    return path.name, dc.build(_cuda.read_source(path), _cuda.compile_options(d))


def test_every_real_kernel_builds_and_every_entry_is_found():
    paths = sorted(_cuda.cuda_dir().glob("*.cu"))
    with ThreadPoolExecutor(2) as pool:               # g++ runs outside the GIL
        modules = dict(pool.map(_build, paths))
    from freetoken.cuda_emu.device_launch import entries
    for path in paths:
        found = entries(path.read_text())
        assert found, path.name
        for name in found:
            assert modules[path.name].get_function(name).name == name


@pytest.mark.parametrize("wdtype", [np.float32, np.uint16])
def test_real_rms_norm_matches_its_reference(wdtype):
    d = _cuda.cuda_dir()
    module = dc.build(_cuda.read_source(d / "rms_norm.cu"), _cuda.compile_options(d))
    rng = np.random.default_rng(3)
    R, H, eps = 5, 300, 1e-6
    x = rng.standard_normal((R, H)).astype(np.float32)
    w32 = rng.standard_normal(H).astype(np.float32)
    w = w32 if wdtype == np.float32 else (w32.view(np.uint32) >> 16).astype(np.uint16)
    px, pw, py = to_device(x), to_device(w), dc.alloc(x.nbytes)
    entry = f"rms_norm_{_cuda.dtype_tag(w)}"
    values = dict(x=px, w=pw, y=py, R=R, H=H, eps=eps)
    args = [values[a.split(":")[0]] if a.endswith("*") else _cuda.SCALAR_TYPES[a.split(":")[1]](
        values[a.split(":")[0]]) for a in rms_norm.ARGS[entry]]
    module.get_function(entry).launch((R, 1, 1), (_cuda.threads(H, 512), 1, 1), 0, args)
    np.testing.assert_allclose(from_device(py, (R, H), np.float32), rms_norm.ref(x, w, eps),
                               rtol=1e-5, atol=1e-5)
