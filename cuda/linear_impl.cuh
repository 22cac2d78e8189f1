// linear_impl.cuh -- the bodies of linear.cu (dense weights) and linear_quant.cu (quantized):
// y[T,M] = x[T,K] @ w[M,K]^T, w a dense `const W*` or a QPtr<C> (gemv_common.cuh); row t of y
// starts at y + t*ldy (ldy >= M: a weight stored in parts writes each part's columns of y).
// gemv_impl: T <= 8, grid (ceil(M/4),), block 128, a warp per output row for all T tokens.
// gemm_impl: any T, grid (ceil(M/64), ceil(T/64)), block 256, one 64x64 output tile per block.
#pragma once
#include "gemv_common.cuh"

#define GEMV_WARPS 4  // output rows per block

template <int NT, typename Mt>
__device__ __forceinline__ void gemv_row(const float* __restrict__ x, Mt w,
                                         float* __restrict__ y, int K, int M,
                                         int ldy) {
  const int m = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (m >= M) return;  // warp-uniform: the whole warp leaves together
  const Mt rows[1] = {mat_row(w, K, m)};
  float acc[1][NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[0][t] = 0.f;
  rows_dot<1, NT>(rows, x, K, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[0][t]);
    if ((threadIdx.x & 31) == 0) y[(size_t)t * ldy + m] = s;
  }
}

// T is a run-time value; each token count gets its own unrolled instance (registers acc[T]).
template <typename Mt>
__device__ void gemv_impl(const float* x, Mt w, float* y, int T, int K, int M, int ldy) {
  switch (T) {
    case 1: gemv_row<1>(x, w, y, K, M, ldy); break;
    case 2: gemv_row<2>(x, w, y, K, M, ldy); break;
    case 3: gemv_row<3>(x, w, y, K, M, ldy); break;
    case 4: gemv_row<4>(x, w, y, K, M, ldy); break;
    case 5: gemv_row<5>(x, w, y, K, M, ldy); break;
    case 6: gemv_row<6>(x, w, y, K, M, ldy); break;
    case 7: gemv_row<7>(x, w, y, K, M, ldy); break;
    case 8: gemv_row<8>(x, w, y, K, M, ldy); break;
    default: break;  // the wrapper only launches 1 <= T <= 8
  }
}

template <typename Mt>
__device__ void gemm_impl(const float* x, Mt w, float* y, int T, int K, int M, int ldy) {
  __shared__ __align__(16) float sw[1][TILE_K][TILE_PAD];
  __shared__ __align__(16) float sx[TILE_K][TILE_PAD];
  __shared__ int srow[TILE_T];
  const int m0 = blockIdx.x * TILE_M, t0 = blockIdx.y * TILE_T;
  const int r = threadIdx.x;
  if (r < TILE_T) srow[r] = t0 + r < T ? t0 + r : -1;
  __syncthreads();
  float acc[1][4][4] = {};
  const Mt ws[1] = {w};
  tile_accumulate<1>(sw, sx, ws, m0, M, x, srow, K, acc);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + ty * 4 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + tx * 4 + j;
      if (t < T && m < M) y[(size_t)t * ldy + m] = acc[0][i][j];
    }
  }
}

