// kv_write.cu -- k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t] (rows of G*D), rounding to
// bf16 (nearest even) for uint16 caches.
// Wrapper: freetoken/kernels/kv_write.py   Spec: kv_write.ref   Test: tests/kernels/test_gpu_kv_write.py
// Launch: grid (T,), block (threads(G*D) <= 256,); one block per new token.
// Needs: k, v [T,G,D], caches [N,G,D] C-contiguous; slots distinct within a call. A slot
//   outside [0, N) cannot raise on the device: that row is skipped (the cpu path raises).
// Numerics: f32 copy, or round-to-nearest-even to bf16 bit for bit like _bf16.from_f32.
#include "common.cuh"

template <typename C>
__device__ __forceinline__ void kv_write_impl(const float* k, const float* v, C* k_cache,
                                              C* v_cache, const int* slots, int T, int GD, int N) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const int s = slots[t];
    if (s < 0 || s >= N) return;
    const long long src = (long long)t * GD, dst = (long long)s * GD;
    for (int j = threadIdx.x; j < GD; j += blockDim.x) {
        store(k_cache, dst + j, k[src + j]);
        store(v_cache, dst + j, v[src + j]);
    }
}

extern "C" __global__ void kv_write_bf16(const float* k, const float* v, u16* k_cache,
                                         u16* v_cache, const int* slots, int T, int GD, int N) {
    kv_write_impl(k, v, k_cache, v_cache, slots, T, GD, N);
}

extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* k_cache,
                                        float* v_cache, const int* slots, int T, int GD, int N) {
    kv_write_impl(k, v, k_cache, v_cache, slots, T, GD, N);
}
