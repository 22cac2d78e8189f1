// experts.cu -- routed SwiGLU experts over bf16 (or f32) banks, fp32 accumulation:
//   out[t] = sum_j w[t,j] * down[e] @ (silu(g) * u),  g, u = split(gate_up[e] @ x[t]),  e = ids[t,j]
// Wrapper: freetoken/kernels/experts.py (gpu)   Spec: experts.ref
// Test: tests/kernels/test_gpu_experts.py, test_gpu_experts_glu.py   Bench: bench/kernels/gpu_decode_kernels.py
// Shapes: x f32[T,H], ids i32[T,k], w f32[T,k], gate_up [S,2I,H] (gate rows first), down [S,H,I],
//   bf16 bits or f32 (quantized banks: experts_quant.cu, the same kernels). Bodies: experts_impl.cuh.
// An id outside [0,S) (the hybrid backend's -1 = "runs on the CPU") is masked: its pair is skipped
// by every kernel, so scratch rows that were never written are never read (no garbage * 0).
//
// Decode (T small), two launches, pair p = t*k + j:
//   experts_gate_up_*: grid (ceil(I/4), T*k), block 128; a warp per row i computes the gate and up
//     rows' dots with x[t] and writes act[p,i] = silu(g)*u (or gpt-oss's: the comment at the end).
//   experts_down_*:    grid (ceil(H/4), T), block 128; a warp per output row h sums
//     w[t,j] * down[e_j][h] . act[p_j] over the k pairs and overwrites out[t,h].
// Prefill, four launches, with no host round trip (so also capture-safe):
//   experts_plan_i32:  grid (1,), block PLAN_THREADS; counting sort of the pairs by expert ->
//     offs[S+1], perm[P] (pair of each sorted position), a table of 64-row tiles per expert.
//   experts_gemm_gate_up_*: grid (G, ceil(I/64)), block 256; block-strided loop over the tiles:
//     act[q,:] (q = sorted position) = silu(X_q @ gate^T) * (X_q @ up^T), X_q = x[perm[q] / k].
//   experts_gemm_down_*:    grid (G, ceil(H/64)), block 256; y[perm[q],:] = act[q,:] @ down^T.
//   experts_combine_f32:    grid (ceil(H/128), T), block 128; out[t] = sum_j w[t,j] * y[t*k+j].
#include "experts_impl.cuh"

#define PLAN_THREADS 1024  // the plan kernel is one block

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
                                                int k, int H, int I, int S,
                                                const float* gu_bias, float alpha, float limit,
                                                int use_bias, int clamped) {
  gate_up_impl(x, ids, gate_up, (size_t)2 * I * H, act, k, H, I, S,
               Glu{gu_bias, alpha, limit, use_bias, clamped});
}

extern "C" __global__ void experts_gate_up_f32(const float* x, const int* ids,
                                               const float* gate_up, float* act,
                                               int k, int H, int I, int S,
                                               const float* gu_bias, float alpha, float limit,
                                               int use_bias, int clamped) {
  gate_up_impl(x, ids, gate_up, (size_t)2 * I * H, act, k, H, I, S,
               Glu{gu_bias, alpha, limit, use_bias, clamped});
}

extern "C" __global__ void experts_down_bf16(const int* ids, const float* weights,
                                             const unsigned short* down, const float* act,
                                             float* out, int k, int H, int I, int S,
                                             const float* dn_bias, int use_bias) {
  down_impl(ids, weights, down, (size_t)H * I, act, out, k, H, I, S,
            Glu{dn_bias, 0.f, 0.f, use_bias, 0});
}

extern "C" __global__ void experts_down_f32(const int* ids, const float* weights,
                                            const float* down, const float* act,
                                            float* out, int k, int H, int I, int S,
                                            const float* dn_bias, int use_bias) {
  down_impl(ids, weights, down, (size_t)H * I, act, out, k, H, I, S,
            Glu{dn_bias, 0.f, 0.f, use_bias, 0});
}

extern "C" __global__ void experts_gemm_gate_up_bf16(
    const float* x, const unsigned short* gate_up, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* act,
    int k, int H, int I, const float* gu_bias, float alpha, float limit, int use_bias,
    int clamped) {
  gemm_tiles<true>(x, gate_up, (size_t)2 * I * H, (size_t)I * H, perm, offs, tile_expert,
                   tile_row, n_tiles, act, k, H, I,
                   Glu{gu_bias, alpha, limit, use_bias, clamped});
}

extern "C" __global__ void experts_gemm_gate_up_f32(
    const float* x, const float* gate_up, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* act,
    int k, int H, int I, const float* gu_bias, float alpha, float limit, int use_bias,
    int clamped) {
  gemm_tiles<true>(x, gate_up, (size_t)2 * I * H, (size_t)I * H, perm, offs, tile_expert,
                   tile_row, n_tiles, act, k, H, I,
                   Glu{gu_bias, alpha, limit, use_bias, clamped});
}

extern "C" __global__ void experts_gemm_down_bf16(
    const float* act, const unsigned short* down, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* y,
    int H, int I, const float* dn_bias, int use_bias) {
  gemm_tiles<false>(act, down, (size_t)H * I, 0, perm, offs, tile_expert, tile_row, n_tiles,
                    y, 1, I, H,
                    Glu{dn_bias, 0.f, 0.f, use_bias, 0});
}

extern "C" __global__ void experts_gemm_down_f32(
    const float* act, const float* down, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* y,
    int H, int I, const float* dn_bias, int use_bias) {
  gemm_tiles<false>(act, down, (size_t)H * I, 0, perm, offs, tile_expert, tile_row, n_tiles,
                    y, 1, I, H,
                    Glu{dn_bias, 0.f, 0.f, use_bias, 0});
}
