// experts.cu -- routed SwiGLU experts over bf16 (or f32) banks, fp32 accumulation:
//   out[t] = sum_j w[t,j] * down[e] @ (silu(g) * u),  g, u = split(gate_up[e] @ x[t]),  e = ids[t,j]
// Wrapper: freetoken/kernels/experts.py (gpu)   Spec: experts.ref
// Test: tests/kernels/test_gpu_experts.py   Bench: bench/kernels/gpu_decode_kernels.py
// Shapes: x f32[T,H], ids i32[T,k], w f32[T,k], gate_up [S,2I,H] (gate rows first), down [S,H,I].
// An id outside [0,S) (the hybrid backend's -1 = "runs on the CPU") is masked: its pair is skipped
// by every kernel, so scratch rows that were never written are never read (no garbage * 0).
//
// Decode (T small), two launches, pair p = t*k + j:
//   experts_gate_up_*: grid (ceil(I/4), T*k), block 128; a warp per row i computes the gate and up
//     rows' dots with x[t] and writes act[p,i] = silu(g)*u.
//   experts_down_*:    grid (ceil(H/4), T), block 128; a warp per output row h sums
//     w[t,j] * down[e_j][h] . act[p_j] over the k pairs and overwrites out[t,h].
// Prefill, four launches, with no host round trip (so also capture-safe):
//   experts_plan_i32:  grid (1,), block PLAN_THREADS; counting sort of the pairs by expert ->
//     offs[S+1], perm[P] (pair of each sorted position), a table of 64-row tiles per expert.
//   experts_gemm_gate_up_*: grid (G, ceil(I/64)), block 256; block-strided loop over the tiles:
//     act[q,:] (q = sorted position) = silu(X_q @ gate^T) * (X_q @ up^T), X_q = x[perm[q] / k].
//   experts_gemm_down_*:    grid (G, ceil(H/64)), block 256; y[perm[q],:] = act[q,:] @ down^T.
//   experts_combine_f32:    grid (ceil(H/128), T), block 128; out[t] = sum_j w[t,j] * y[t*k+j].
#include "gemv_common.cuh"

#define GEMV_WARPS 4       // rows per 128-thread block in the decode kernels
#define PLAN_THREADS 1024  // the plan kernel is one block

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }
__device__ __forceinline__ bool routed(int e, int S) { return e >= 0 && e < S; }

template <typename W>
__device__ void gate_up_impl(const float* x, const int* ids, const W* gate_up, float* act,
                             int k, int H, int I, int S) {
  const int p = blockIdx.y, e = ids[p], i = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (!routed(e, S) || i >= I) return;  // uniform per warp
  const W* bank = gate_up + (size_t)e * 2 * I * H;
  const W* const rows[2] = {bank + (size_t)i * H, bank + (size_t)(I + i) * H};
  float acc[2][1] = {{0.f}, {0.f}};
  rows_dot<2, 1>(rows, x + (size_t)(p / k) * H, H, acc);
  const float g = warp_sum(acc[0][0]), u = warp_sum(acc[1][0]);
  if ((threadIdx.x & 31) == 0) act[(size_t)p * I + i] = silu(g) * u;
}

template <typename W>
__device__ void down_impl(const int* ids, const float* weights, const W* down, const float* act,
                          float* out, int k, int H, int I, int S) {
  const int t = blockIdx.y, h = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (h >= H) return;
  float acc = 0.f;
  for (int j = 0; j < k; ++j) {
    const int p = t * k + j, e = ids[p];
    if (!routed(e, S)) continue;
    const W* const rows[1] = {down + ((size_t)e * H + h) * I};
    float part[1][1] = {{0.f}};
    rows_dot<1, 1>(rows, act + (size_t)p * I, I, part);
    acc += weights[p] * part[0][0];  // linear in the lane partials: one reduction at the end
  }
  const float s = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) out[(size_t)t * H + h] = s;
}

// Thread tid owns experts [e0, e1): count sums, then a block scan gives every group's offset.
__device__ void plan_offsets(int S, int* offs, int* cursor, int* tile_expert, int* tile_row,
                             int* n_tiles) {
  __shared__ int s_cnt[PLAN_THREADS], s_til[PLAN_THREADS];
  const int tid = threadIdx.x, per = (S + PLAN_THREADS - 1) / PLAN_THREADS;
  const int e0 = min(S, tid * per), e1 = min(S, e0 + per);
  int c = 0, tl = 0;
  for (int e = e0; e < e1; ++e) c += cursor[e], tl += (cursor[e] + TILE_T - 1) / TILE_T;
  s_cnt[tid] = c;
  s_til[tid] = tl;
  __syncthreads();
  for (int off = 1; off < PLAN_THREADS; off <<= 1) {  // inclusive Hillis-Steele scan
    const int a = tid >= off ? s_cnt[tid - off] : 0, b = tid >= off ? s_til[tid - off] : 0;
    __syncthreads();
    s_cnt[tid] += a;
    s_til[tid] += b;
    __syncthreads();
  }
  int base = s_cnt[tid] - c, tb = s_til[tid] - tl;
  for (int e = e0; e < e1; ++e) {
    const int n = cursor[e];
    offs[e] = base;
    cursor[e] = base;  // becomes the scatter cursor of group e
    for (int r = 0; r < n; r += TILE_T, ++tb) tile_expert[tb] = e, tile_row[tb] = base + r;
    base += n;
  }
  if (tid == PLAN_THREADS - 1) offs[S] = s_cnt[tid], *n_tiles = s_til[tid];
}

// Within a group the order of pairs depends on atomics, but each output row is computed alone
// (same x row, same weights, same summation order), so results do not depend on it.
extern "C" __global__ void experts_plan_i32(const int* ids, int P, int S, int* offs, int* cursor,
                                            int* perm, int* tile_expert, int* tile_row,
                                            int* n_tiles) {
  const int tid = threadIdx.x;
  for (int e = tid; e < S; e += PLAN_THREADS) cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += PLAN_THREADS)
    if (routed(ids[p], S)) atomicAdd(&cursor[ids[p]], 1);
  __syncthreads();
  plan_offsets(S, offs, cursor, tile_expert, tile_row, n_tiles);
  __syncthreads();
  for (int p = tid; p < P; p += PLAN_THREADS)
    if (routed(ids[p], S)) perm[atomicAdd(&cursor[ids[p]], 1)] = p;
}

// Shared by both GEMMs: loop over the tiles of the plan; srow[r] = activation row of tile row r.
// gate_up = true: rows are tokens perm[q] / k and the epilogue writes silu(g) * u to act[q];
// else rows are act rows q and the epilogue writes y[perm[q]].
template <bool GATE_UP, typename W>
__device__ void gemm_tiles(const float* xin, const W* bank0, size_t bank_stride,
                           size_t second_offset, const int* perm, const int* offs,
                           const int* tile_expert, const int* tile_row, const int* n_tiles,
                           float* yout, int k, int K, int M) {
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
    const W* bank = bank0 + (size_t)e * bank_stride;
    const W* const ws[2] = {bank, bank + second_offset};  // NW == 1 reads only the first
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
        yout[out_row * M + m] = GATE_UP ? silu(acc[0][i][j]) * acc[NW - 1][i][j] : acc[0][i][j];
      }
    }
  }
}

extern "C" __global__ void experts_combine_f32(const int* ids, const float* weights,
                                               const float* y, float* out, int k, int H, int S) {
  const int t = blockIdx.y, h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= H) return;
  float acc = 0.f;
  for (int j = 0; j < k; ++j) {
    const int p = t * k + j;
    if (routed(ids[p], S)) acc += weights[p] * y[(size_t)p * H + h];
  }
  out[(size_t)t * H + h] = acc;
}

extern "C" __global__ void experts_gate_up_bf16(const float* x, const int* ids,
                                                const unsigned short* gate_up, float* act,
                                                int k, int H, int I, int S) {
  gate_up_impl(x, ids, gate_up, act, k, H, I, S);
}

extern "C" __global__ void experts_gate_up_f32(const float* x, const int* ids,
                                               const float* gate_up, float* act,
                                               int k, int H, int I, int S) {
  gate_up_impl(x, ids, gate_up, act, k, H, I, S);
}

extern "C" __global__ void experts_down_bf16(const int* ids, const float* weights,
                                             const unsigned short* down, const float* act,
                                             float* out, int k, int H, int I, int S) {
  down_impl(ids, weights, down, act, out, k, H, I, S);
}

extern "C" __global__ void experts_down_f32(const int* ids, const float* weights,
                                            const float* down, const float* act,
                                            float* out, int k, int H, int I, int S) {
  down_impl(ids, weights, down, act, out, k, H, I, S);
}

extern "C" __global__ void experts_gemm_gate_up_bf16(
    const float* x, const unsigned short* gate_up, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* act,
    int k, int H, int I) {
  gemm_tiles<true>(x, gate_up, (size_t)2 * I * H, (size_t)I * H, perm, offs, tile_expert,
                   tile_row, n_tiles, act, k, H, I);
}

extern "C" __global__ void experts_gemm_gate_up_f32(
    const float* x, const float* gate_up, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* act,
    int k, int H, int I) {
  gemm_tiles<true>(x, gate_up, (size_t)2 * I * H, (size_t)I * H, perm, offs, tile_expert,
                   tile_row, n_tiles, act, k, H, I);
}

extern "C" __global__ void experts_gemm_down_bf16(
    const float* act, const unsigned short* down, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* y,
    int H, int I) {
  gemm_tiles<false>(act, down, (size_t)H * I, 0, perm, offs, tile_expert, tile_row, n_tiles,
                    y, 1, I, H);
}

extern "C" __global__ void experts_gemm_down_f32(
    const float* act, const float* down, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* y,
    int H, int I) {
  gemm_tiles<false>(act, down, (size_t)H * I, 0, perm, offs, tile_expert, tile_row, n_tiles,
                    y, 1, I, H);
}
