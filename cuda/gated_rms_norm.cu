// gated_rms_norm.cu -- y = x * rsqrt(mean(x^2) + eps) * w * silu(z) over the last axis (R rows of
// D; the Gated DeltaNet output norm per value head, R = T*Hv, D = Dv = 128).
// Wrapper: freetoken/kernels/gated_rms_norm.py   Spec: gated_rms_norm.ref
// Test: tests/kernels/test_gpu_gated_rms_norm.py
// Launch: grid (R,), block (threads(D) <= 512,); one block per row, as rms_norm.cu.
// Needs: rows C-contiguous; y may be x or z (each element is read and written by the same
//   thread, the write after the reduction).
// Numerics: fp32 sum of squares (block tree order), 1/sqrtf, silu = z / (1 + expf(-z)) (expf
//   overflow to inf gives -0, as numpy), weights bf16 or f32 used as stored (no 1 + w).
#include "common.cuh"

template <typename W>
__device__ __forceinline__ void gated_rms_norm_impl(const float* x, const float* z, const W* w,
                                                    float* y, int R, int D, float eps) {
    __shared__ float scratch[MAX_WARPS];
    const int r = blockIdx.x;
    if (r >= R) return;
    const long long off = (long long)r * D;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += x[off + i] * x[off + i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float g = z[off + i];
        y[off + i] = x[off + i] * inv * load(w, i) * (g / (1.0f + expf(-g)));
    }
}

extern "C" __global__ void gated_rms_norm_bf16(const float* x, const float* z, const u16* w,
                                               float* y, int R, int D, float eps) {
    gated_rms_norm_impl(x, z, w, y, R, D, eps);
}

extern "C" __global__ void gated_rms_norm_f32(const float* x, const float* z, const float* w,
                                              float* y, int R, int D, float eps) {
    gated_rms_norm_impl(x, z, w, y, R, D, eps);
}
