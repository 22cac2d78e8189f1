// gemv_common.cuh -- weight loads, warp row-dot products and the shared-memory GEMM tile used by
// linear.cu, experts.cu and attention.cu.
// Weights arrive as bf16 bits (u16) or f32 and are widened to f32 on load, or as quantized blocks
// (QPtr<C>, qblocks.cuh) dequantized on load; all accumulation is f32. Work is done in 8-element
// chunks: one 16-byte load of bf16, two of f32, the bytes of 8 values of a block. Dense vector
// paths need K % 8 == 0 and 16-byte aligned rows (checked at run time, since a contiguous view may
// start at an odd offset); every other case takes a scalar path, so any K is correct. A
// quantized row is whole blocks (K % 32 == 0), so it always takes the vector path.
// A weight matrix is `const W*` (dense) or QPtr<C>: mat_row / mat_skip / mat_units address both.
#pragma once
#include "common.cuh"
#include "qblocks.cuh"

__device__ __forceinline__ float to_f32(unsigned short v) { return bf16_to_f32(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Every lane gets the result (common.cuh's butterflies already do; the broadcast keeps callers
// correct should those become shfl_down reductions, for one shuffle).
__device__ __forceinline__ float warp_allsum(float v) {
  return __shfl_sync(FULL_MASK, warp_sum(v), 0);
}
__device__ __forceinline__ float warp_allmax(float v) {
  return __shfl_sync(FULL_MASK, warp_max(v), 0);
}

// 8 elements at p (16-byte aligned), widened. bf16 element 2i is the low half of word i.
__device__ __forceinline__ void load8(const unsigned short* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
// the first n elements at p (any alignment, n may be <= 0), zeros after
template <typename W>
__device__ __forceinline__ void load8_n(const W* p, int n, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = i < n ? to_f32(p[i]) : 0.f;
}

// --- weight matrices and rows: dense `const W*` or quantized QPtr<C> -------------------------
// Storage units: elements of W, or bytes of blocks. mat_units(w, K): units of a row of K values.
template <typename W> __device__ __forceinline__ size_t mat_units(const W*, int K) { return K; }
template <int C> __device__ __forceinline__ size_t mat_units(QPtr<C>, int K) { return q_row_bytes<C>(K); }
// w advanced by n storage units (an expert's slot, the up half of gate_up)
template <typename W> __device__ __forceinline__ const W* mat_skip(const W* w, size_t n) { return w + n; }
template <int C> __device__ __forceinline__ QPtr<C> mat_skip(QPtr<C> w, size_t n) { return {w.p + n}; }
// row m of a matrix of rows of K values
template <typename M> __device__ __forceinline__ M mat_row(M w, int K, size_t m) {
  return mat_skip(w, m * mat_units(w, K));
}
template <int C> __device__ __forceinline__ bool aligned16(QPtr<C>) { return true; }
// values k .. k+7 of a row (k % 8 == 0; dense: 16-byte aligned at k)
template <typename W> __device__ __forceinline__ void row_load8(const W* row, int k, float (&v)[8]) {
  load8(row + k, v);
}
template <int C> __device__ __forceinline__ void row_load8(QPtr<C> row, int k, float (&v)[8]) {
  qload8<C>(row.p, k, v);
}
// the first n values from k (n may be <= 0: nothing is read), zeros after
template <typename W>
__device__ __forceinline__ void row_load8_n(const W* row, int k, int n, float (&v)[8]) {
  load8_n(row + k, n, v);
}
template <int C>
__device__ __forceinline__ void row_load8_n(QPtr<C> row, int k, int n, float (&v)[8]) {
  if (n > 0) qload8<C>(row.p, k, v);  // a quantized row has whole blocks: n >= 8 when n > 0
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = i < n ? v[i] : 0.f;
}

// --- warp row-dot products (decode GEMVs) ---------------------------------------------------
// acc[r][t] += lane's share of dot(rows[r][0..K), x[t*K .. t*K+K)) for NR weight rows and NT
// activation rows; reduce acc across the warp afterwards. Chunks are strided over the lanes and
// ROW_UNROLL of them are loaded before use, so each lane keeps NR*ROW_UNROLL 16-byte weight
// loads in flight: decode is bound by weight bandwidth, not by arithmetic.
#define ROW_UNROLL 4

// Any K and alignment: one element per lane per step.
template <int NR, int NT, typename W>
__device__ __forceinline__ void rows_dot_scalar(const W* const (&rows)[NR], const float* x, int K,
                                                float (&acc)[NR][NT]) {
  for (int k = threadIdx.x & 31; k < K; k += 32)
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float wk = to_f32(rows[r][k]);
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] += wk * x[(size_t)t * K + k];
    }
}
// Quantized rows (whole blocks, so K % 8 == 0) with an unaligned x: 8 values per lane per step.
template <int NR, int NT, int C>
__device__ __forceinline__ void rows_dot_scalar(const QPtr<C> (&rows)[NR], const float* x, int K,
                                                float (&acc)[NR][NT]) {
  for (int k = 8 * (threadIdx.x & 31); k < K; k += 256)
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float wv[8];
      qload8<C>(rows[r].p, k, wv);
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][t] += wv[i] * x[(size_t)t * K + k + i];
    }
}

template <int NR, int NT, typename R>
__device__ __forceinline__ void rows_dot(const R (&rows)[NR], const float* x, int K,
                                         float (&acc)[NR][NT]) {
  bool vec = (K & 7) == 0 && aligned16(x);
#pragma unroll
  for (int r = 0; r < NR; ++r) vec = vec && aligned16(rows[r]);
  if (!vec) return rows_dot_scalar<NR, NT>(rows, x, K, acc);
  const int nc = K >> 3;
  for (int c0 = threadIdx.x & 31; c0 < nc; c0 += 32 * ROW_UNROLL) {
    float wv[NR][ROW_UNROLL][8];
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (c0 + 32 * u < nc) row_load8(rows[r], 8 * (c0 + 32 * u), wv[r][u]);
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u) {
      if (c0 + 32 * u >= nc) continue;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float xv[8];
        load8(x + (size_t)t * K + 8 * (c0 + 32 * u), xv);
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][t] += wv[r][u][i] * xv[i];
      }
    }
  }
}

// --- shared-memory GEMM tile (prefill) --------------------------------------------------------
// A block of TILE_THREADS computes a TILE_T x TILE_M output tile: activation rows (tokens, maybe
// gathered through srow) times weight rows, in TILE_K-deep slabs widened to f32 in shared memory.
// Thread (tx, ty) owns weight columns tx*4..+4 and activation rows ty*4..+4 (4x4 fp32 FMAs per
// slab step). fp32 FMA on purpose: the same numerics as the numpy reference, no tensor cores.
#define TILE_M 64
#define TILE_T 64
#define TILE_K 32
#define TILE_THREADS 256
#define TILE_PAD (TILE_M + 4)  // keeps float4 alignment of rows and spreads shared-memory banks

// sw[k][m] = w[m0+m][k0+k]; zeros outside [0,M) x [0,K). Thread: row tid/4, 8 columns.
template <typename Mt>
__device__ __forceinline__ void stage_w(float (*sw)[TILE_PAD], Mt w, int m0, int M, int K,
                                        int k0, bool vec) {
  const int r = threadIdx.x >> 2, kc = (threadIdx.x & 3) * 8, m = m0 + r, k = k0 + kc;
  const Mt row = mat_row(w, K, m < M ? m : 0);
  float v[8];
  if (m < M && vec && k < K) row_load8(row, k, v);   // vec implies K % 8 == 0: k < K means k + 8 <= K
  else row_load8_n(row, k, m < M ? K - k : 0, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) sw[kc + i][r] = v[i];
}

// sx[k][r] = x[srow[r]][k0+k]; a row index < 0 stages zeros.
__device__ __forceinline__ void stage_x(float (*sx)[TILE_PAD], const float* x, const int* srow,
                                        int K, int k0, bool vec) {
  const int r = threadIdx.x >> 2, kc = (threadIdx.x & 3) * 8, row = srow[r], k = k0 + kc;
  const float* p = x + (size_t)(row < 0 ? 0 : row) * K + k;
  float v[8];
  if (row >= 0 && vec && k < K) load8(p, v);
  else load8_n(p, row >= 0 ? K - k : 0, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) sx[kc + i][r] = v[i];
}

// acc[NW][i][j] += sum over the whole K of x[srow[ty*4+i]] . w[NW][m0+tx*4+j]; sw holds NW slabs.
// Must be called by all TILE_THREADS threads (it synchronises the block).
template <int NW, typename Mt>
__device__ void tile_accumulate(float (*sw)[TILE_K][TILE_PAD], float (*sx)[TILE_PAD],
                                const Mt* w, int m0, int M, const float* x,
                                const int* srow, int K, float (&acc)[NW][4][4]) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  bool wvec = (K & 7) == 0;
#pragma unroll
  for (int n = 0; n < NW; ++n) wvec = wvec && aligned16(w[n]);
  const bool xvec = (K & 7) == 0 && aligned16(x);
  for (int k0 = 0; k0 < K; k0 += TILE_K) {
#pragma unroll
    for (int n = 0; n < NW; ++n) stage_w(sw[n], w[n], m0, M, K, k0, wvec);
    stage_x(sx, x, srow, K, k0, xvec);
    __syncthreads();
#pragma unroll 4
    for (int kk = 0; kk < TILE_K; ++kk) {
      const float4 xv = *reinterpret_cast<const float4*>(&sx[kk][ty * 4]);
      const float a[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int n = 0; n < NW; ++n) {
        const float4 wv = *reinterpret_cast<const float4*>(&sw[n][kk][tx * 4]);
        const float b[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[n][i][j] += a[i] * b[j];
      }
    }
    __syncthreads();
  }
}
