// rms_norm.cu -- y = x / sqrt(mean(x^2) + eps) * w over the last axis (R rows of H), and the
// fused residual variant add_rms_norm: x += residual (written back), y = rms_norm(x).
// Wrappers: freetoken/kernels/rms_norm.py, freetoken/kernels/add_rms_norm.py
// Spec: rms_norm.ref, add_rms_norm.ref   Tests: tests/kernels/test_gpu_rms_norm.py, test_gpu_add_rms_norm.py
// Launch: grid (R,), block (threads(H) <= 512,); one block per row (per head when R = T*heads).
// Needs: rows C-contiguous; y may be x for rms_norm (each element is read and written by the
//   same thread, the write after the reduction), but not for add_rms_norm (x keeps the sum).
// Numerics: fp32 sum of squares (block tree order), 1/sqrtf, weights bf16 or f32.
#include "common.cuh"

template <typename W>
__device__ __forceinline__ void rms_norm_row(const float* x, const W* w, float* y, int H,
                                             float eps, float* scratch) {
    float ss = 0.0f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) ss += x[h] * x[h];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int h = threadIdx.x; h < H; h += blockDim.x) y[h] = x[h] * inv * load(w, h);
}

template <typename W>
__device__ __forceinline__ void rms_norm_impl(const float* x, const W* w, float* y, int R, int H,
                                              float eps) {
    __shared__ float scratch[MAX_WARPS];
    const int r = blockIdx.x;
    if (r >= R) return;
    const long long off = (long long)r * H;
    rms_norm_row(x + off, w, y + off, H, eps, scratch);
}

template <typename W>
__device__ __forceinline__ void add_rms_norm_impl(float* x, const float* residual, const W* w,
                                                  float* y, int R, int H, float eps) {
    __shared__ float scratch[MAX_WARPS];
    const int r = blockIdx.x;
    if (r >= R) return;
    const long long off = (long long)r * H;
    // the same thread re-reads each sum in rms_norm_row, so no barrier is needed between
    for (int h = threadIdx.x; h < H; h += blockDim.x) x[off + h] += residual[off + h];
    rms_norm_row(x + off, w, y + off, H, eps, scratch);
}

extern "C" __global__ void rms_norm_bf16(const float* x, const u16* w, float* y, int R, int H,
                                         float eps) {
    rms_norm_impl(x, w, y, R, H, eps);
}

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* y, int R, int H,
                                        float eps) {
    rms_norm_impl(x, w, y, R, H, eps);
}

extern "C" __global__ void add_rms_norm_bf16(float* x, const float* residual, const u16* w,
                                             float* y, int R, int H, float eps) {
    add_rms_norm_impl(x, residual, w, y, R, H, eps);
}

extern "C" __global__ void add_rms_norm_f32(float* x, const float* residual, const float* w,
                                            float* y, int R, int H, float eps) {
    add_rms_norm_impl(x, residual, w, y, R, H, eps);
}
