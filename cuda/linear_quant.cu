// linear_quant.cu -- y[T,M] = x[T,K] @ w[M,K]^T, w quantized blocks u8[M,K/V,B] of one format:
// QFMT, a format code of qblocks.cuh (-DQFMT=7 for q4_k; the loader builds one module per format a
// model uses). The values are dequantized as the spec does, the products accumulated in f32.
// Wrapper: freetoken/kernels/linear.py (gpu)   Spec: linear.ref   Test: tests/kernels/test_gpu_quant.py
// linear_gemv_q: T <= 8, grid (ceil(M/4),), block 128.  linear_gemm_q: grid (ceil(M/64), ceil(T/64)),
// block 256. Needs K % V == 0 (whole blocks), x and y contiguous.
#include "linear_impl.cuh"

#ifndef QFMT
#define QFMT Q8_0
#endif

extern "C" __global__ void linear_gemv_q(const float* x, const u8* w, float* y, int T, int K,
                                         int M, int ldy) {
  gemv_impl(x, QPtr<QFMT>{w}, y, T, K, M, ldy);
}

extern "C" __global__ void linear_gemm_q(const float* x, const u8* w, float* y, int T, int K,
                                         int M, int ldy) {
  gemm_impl(x, QPtr<QFMT>{w}, y, T, K, M, ldy);
}
