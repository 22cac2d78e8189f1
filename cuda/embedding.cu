// embedding.cu -- out[t] = float32(table[ids[t]]): token embedding row gather, widened to fp32.
// Wrapper: freetoken/kernels/embedding.py   Spec: embedding.ref   Test: tests/kernels/test_gpu_embedding.py
// Launch: grid (T,), block (threads(H/4) <= 256,); one block per token row.
// Needs: table [V,H] and out [T,H] C-contiguous. Ids outside [0, V) cannot raise on the device:
//   their row is written as NaN so the bug shows instead of reading out of bounds.
// Numerics: exact (bf16 -> f32 is a shift).
#include "common.cuh"

template <typename W>
__device__ __forceinline__ void embedding_impl(const int* ids, const W* table, float* out,
                                               int T, int H, int V) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const int id = ids[t];
    float* dst = out + (long long)t * H;
    if (id < 0 || id >= V) {
        for (int h = threadIdx.x; h < H; h += blockDim.x) dst[h] = quiet_nan();
        return;
    }
    const W* src = table + (long long)id * H;
    for (int h = threadIdx.x; h < H; h += blockDim.x) dst[h] = load(src, h);
}

extern "C" __global__ void embedding_bf16(const int* ids, const u16* table, float* out,
                                          int T, int H, int V) {
    embedding_impl(ids, table, out, T, H, V);
}

extern "C" __global__ void embedding_f32(const int* ids, const float* table, float* out,
                                         int T, int H, int V) {
    embedding_impl(ids, table, out, T, H, V);
}
