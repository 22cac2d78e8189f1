// linear.cu -- y[T,M] = x[T,K] @ w[M,K]^T with fp32 accumulation; w is bf16 bits or f32
// (quantized blocks: linear_quant.cu). The bodies: linear_impl.cuh.
// Wrapper: freetoken/kernels/linear.py (gpu)   Spec: linear.ref
// Test: tests/kernels/test_gpu_linear.py   Bench: bench/kernels/gpu_decode_kernels.py
// linear_gemv_*: T <= GEMV_MAX_T (8). grid (ceil(M/4),), block 128: a warp per output row reads
//   the row once for all T tokens (decode is weight-bandwidth bound); 16-byte loads when possible.
// linear_gemm_*: any T. grid (ceil(M/64), ceil(T/64)), block 256: one 64x64 output tile per block
//   from shared-memory slabs (gemv_common.cuh). fp32 FMA rather than bf16 tensor cores, so the
//   activations are never rounded to bf16 and prefill matches ref's numerics.
// Also the lm_head (M = V). Needs: x, y contiguous; any T, K, M.
#include "linear_impl.cuh"

extern "C" __global__ void linear_gemv_bf16(const float* x, const unsigned short* w, float* y,
                                            int T, int K, int M, int ldy) {
  gemv_impl(x, w, y, T, K, M, ldy);
}

extern "C" __global__ void linear_gemv_f32(const float* x, const float* w, float* y,
                                           int T, int K, int M, int ldy) {
  gemv_impl(x, w, y, T, K, M, ldy);
}

extern "C" __global__ void linear_gemm_bf16(const float* x, const unsigned short* w, float* y,
                                            int T, int K, int M, int ldy) {
  gemm_impl(x, w, y, T, K, M, ldy);
}

extern "C" __global__ void linear_gemm_f32(const float* x, const float* w, float* y,
                                           int T, int K, int M, int ldy) {
  gemm_impl(x, w, y, T, K, M, ldy);
}
