// linear.cu -- y[T,M] = x[T,K] @ w[M,K]^T with fp32 accumulation; w is bf16 bits or f32.
// Wrapper: freetoken/kernels/linear.py (gpu)   Spec: linear.ref
// Test: tests/kernels/test_gpu_linear.py   Bench: bench/kernels/gpu_decode_kernels.py
// linear_gemv_*: T <= GEMV_MAX_T (8). grid (ceil(M/4),), block 128: a warp per output row reads
//   the row once for all T tokens (decode is weight-bandwidth bound); 16-byte loads when possible.
// linear_gemm_*: any T. grid (ceil(M/64), ceil(T/64)), block 256: one 64x64 output tile per block
//   from shared-memory slabs (gemv_common.cuh). fp32 FMA rather than bf16 tensor cores, so the
//   activations are never rounded to bf16 and prefill matches ref's numerics.
// Also the lm_head (M = V). Needs: x, y contiguous; any T, K, M.
#include "gemv_common.cuh"

#define GEMV_WARPS 4  // output rows per block

template <int NT, typename W>
__device__ __forceinline__ void gemv_row(const float* __restrict__ x, const W* __restrict__ w,
                                         float* __restrict__ y, int K, int M) {
  const int m = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (m >= M) return;  // warp-uniform: the whole warp leaves together
  const W* const rows[1] = {w + (size_t)m * K};
  float acc[1][NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[0][t] = 0.f;
  rows_dot<1, NT>(rows, x, K, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[0][t]);
    if ((threadIdx.x & 31) == 0) y[(size_t)t * M + m] = s;
  }
}

// T is a run-time value; each token count gets its own unrolled instance (registers acc[T]).
template <typename W>
__device__ void gemv_impl(const float* x, const W* w, float* y, int T, int K, int M) {
  switch (T) {
    case 1: gemv_row<1>(x, w, y, K, M); break;
    case 2: gemv_row<2>(x, w, y, K, M); break;
    case 3: gemv_row<3>(x, w, y, K, M); break;
    case 4: gemv_row<4>(x, w, y, K, M); break;
    case 5: gemv_row<5>(x, w, y, K, M); break;
    case 6: gemv_row<6>(x, w, y, K, M); break;
    case 7: gemv_row<7>(x, w, y, K, M); break;
    case 8: gemv_row<8>(x, w, y, K, M); break;
    default: break;  // the wrapper only launches 1 <= T <= 8
  }
}

template <typename W>
__device__ void gemm_impl(const float* x, const W* w, float* y, int T, int K, int M) {
  __shared__ __align__(16) float sw[1][TILE_K][TILE_PAD];
  __shared__ __align__(16) float sx[TILE_K][TILE_PAD];
  __shared__ int srow[TILE_T];
  const int m0 = blockIdx.x * TILE_M, t0 = blockIdx.y * TILE_T;
  const int r = threadIdx.x;
  if (r < TILE_T) srow[r] = t0 + r < T ? t0 + r : -1;
  __syncthreads();
  float acc[1][4][4] = {};
  const W* const ws[1] = {w};
  tile_accumulate<1>(sw, sx, ws, m0, M, x, srow, K, acc);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + ty * 4 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + tx * 4 + j;
      if (t < T && m < M) y[(size_t)t * M + m] = acc[0][i][j];
    }
  }
}

extern "C" __global__ void linear_gemv_bf16(const float* x, const unsigned short* w, float* y,
                                            int T, int K, int M) {
  gemv_impl(x, w, y, T, K, M);
}

extern "C" __global__ void linear_gemv_f32(const float* x, const float* w, float* y,
                                           int T, int K, int M) {
  gemv_impl(x, w, y, T, K, M);
}

extern "C" __global__ void linear_gemm_bf16(const float* x, const unsigned short* w, float* y,
                                            int T, int K, int M) {
  gemm_impl(x, w, y, T, K, M);
}

extern "C" __global__ void linear_gemm_f32(const float* x, const float* w, float* y,
                                           int T, int K, int M) {
  gemm_impl(x, w, y, T, K, M);
}
