// experts_impl.cuh -- the bodies of experts.cu (dense banks) and experts_quant.cu (quantized):
// the decode GEMVs over routed pairs and the prefill GEMM tiles, over a bank that is a dense
// `const W*` or a QPtr<C> (gemv_common.cuh), with the slot stride in storage units (elements, or
// bytes of blocks). The launch geometry and the plan are described in experts.cu.
#pragma once
#include "gemv_common.cuh"

#define GEMV_WARPS 4       // rows per 128-thread block in the decode kernels

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }
__device__ __forceinline__ bool routed(int e, int S) { return e >= 0 && e < S; }

// gpt-oss's additions (experts.ref's bias= and glu=), off unless asked: a bias per expert row,
// added to the bank's dot before the activation (gate_up: bias f32[S,2I]) or before the routing
// weight (down: f32[S,H]); the clamped SwiGLU with (alpha, limit). bias is any valid pointer,
// unread, when use_bias is 0. The clamps keep a NaN, as numpy's minimum and clip do.
struct Glu {
  const float* bias;
  float alpha, limit;
  int use_bias, clamped;

  __device__ float act(int e, int i, int I, float g, float u) const {
    if (use_bias) g += bias[(size_t)e * 2 * I + i], u += bias[(size_t)e * 2 * I + I + i];
    if (!clamped) return silu(g) * u;
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
  }
  __device__ float down(int e, int h, int H, float y) const {
    return use_bias ? y + bias[(size_t)e * H + h] : y;
  }
};

// stride: storage units (elements, or bytes of blocks) from one slot to the next
template <typename Mt>
__device__ void gate_up_impl(const float* x, const int* ids, Mt gate_up, size_t stride,
                             float* act, int k, int H, int I, int S, Glu glu) {
  const int p = blockIdx.y, e = ids[p], i = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (!routed(e, S) || i >= I) return;  // uniform per warp
  const Mt bank = mat_skip(gate_up, (size_t)e * stride);
  const Mt rows[2] = {mat_row(bank, H, i), mat_row(bank, H, I + i)};
  float acc[2][1] = {{0.f}, {0.f}};
  rows_dot<2, 1>(rows, x + (size_t)(p / k) * H, H, acc);
  const float g = warp_sum(acc[0][0]), u = warp_sum(acc[1][0]);
  if ((threadIdx.x & 31) == 0) act[(size_t)p * I + i] = glu.act(e, i, I, g, u);
}

template <typename Mt>
__device__ void down_impl(const int* ids, const float* weights, Mt down, size_t stride,
                          const float* act, float* out, int k, int H, int I, int S, Glu glu) {
  const int t = blockIdx.y, h = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (h >= H) return;
  float acc = 0.f;
  for (int j = 0; j < k; ++j) {
    const int p = t * k + j, e = ids[p];
    if (!routed(e, S)) continue;
    const Mt rows[1] = {mat_row(mat_skip(down, (size_t)e * stride), I, h)};
    float part[1][1] = {{0.f}};
    rows_dot<1, 1>(rows, act + (size_t)p * I, I, part);
    acc += weights[p] * part[0][0];  // linear in the lane partials: one reduction at the end
    if ((threadIdx.x & 31) == 0) acc += weights[p] * glu.down(e, h, H, 0.f);  // the bias, once
  }
  const float s = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) out[(size_t)t * H + h] = s;
}

// Shared by both GEMMs: loop over the tiles of the plan; srow[r] = activation row of tile row r.
// gate_up = true: rows are tokens perm[q] / k and the epilogue writes the SwiGLU of (g, u) to
// act[q]; else rows are act rows q and the epilogue writes y[perm[q]] (+ down's bias).
template <bool GATE_UP, typename Mt>
__device__ void gemm_tiles(const float* xin, Mt bank0, size_t bank_stride,
                           size_t second_offset, const int* perm, const int* offs,
                           const int* tile_expert, const int* tile_row, const int* n_tiles,
                           float* yout, int k, int K, int M, Glu glu) {
  constexpr int NW = GATE_UP ? 2 : 1;
  __shared__ __align__(16) float sw[NW][TILE_K][TILE_PAD];
  __shared__ __align__(16) float sx[TILE_K][TILE_PAD];
  __shared__ int srow[TILE_T];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4, m0 = blockIdx.y * TILE_M;
  const int count = *n_tiles;
  for (int tile = blockIdx.x; tile < count; tile += gridDim.x) {  // count is block-uniform
    const int e = tile_expert[tile], r0 = tile_row[tile], end = offs[e + 1];
    __syncthreads();  // the previous tile is done with srow
    if (tid < TILE_T) srow[tid] = r0 + tid >= end ? -1 : (GATE_UP ? perm[r0 + tid] / k : r0 + tid);
    __syncthreads();
    const Mt bank = mat_skip(bank0, (size_t)e * bank_stride);
    const Mt ws[2] = {bank, mat_skip(bank, second_offset)};  // NW == 1 reads only the first
    float acc[NW][4][4] = {};
    tile_accumulate<NW>(sw, sx, ws, m0, M, xin, srow, K, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = r0 + ty * 4 + i;
      if (q >= end) continue;
      const size_t out_row = GATE_UP ? (size_t)q : (size_t)perm[q];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = m0 + tx * 4 + j;
        if (m >= M) continue;
        yout[out_row * M + m] = GATE_UP ? glu.act(e, m, M, acc[0][i][j], acc[NW - 1][i][j])
                                        : glu.down(e, m, M, acc[0][i][j]);
      }
    }
  }
}

