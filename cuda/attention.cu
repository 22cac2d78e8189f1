// attention.cu -- causal GQA attention over the token-slot KV pool; fp32 dot products and softmax.
// Wrapper: freetoken/kernels/attention.py (gpu)   Spec: attention.ref
// Test: tests/kernels/test_gpu_attention.py, test_gpu_attention_sinks.py   Bench: bench/kernels/gpu_decode_kernels.py
// Token t (sequence s = tok_seq[t], position p = tok_pos[t]) attends to slots slot_table[s, f..p];
// head h reads kv group g = h / rep, rep = Hq/G. q, out f32[T,Hq,D]; caches [N,G,D] bf16 or f32.
// gpt-oss: a sliding window W > 0 starts the keys at f = max(0, p - W + 1) (else f = 0); with
// use_sinks, sinks[h] joins head h's softmax denominator as exp(sinks[h] - m) and its weight is
// dropped (sinks is any valid pointer, unread, without). Both are folded in where the partial
// softmaxes merge: the decode reduce and the prefill epilogue.
//
// attention_decode_*: grid (nch, G, T), block 128, dynamic smem (rep*D + rep*CH + CH) * 4 bytes.
//   One block per (token, kv group, chunk of CH positions) serves all rep heads of the group, so
//   each K/V row is read once for them; split-K over the context (flash-decoding) keeps the GPU
//   busy at batch 1 and 40k contexts. Chunks count from f (the window's start); those past a
//   token's context exit at once and write nothing. Writes unnormalised partials
//   part_o[T,Hq,nch,D] and (max, sum) part_ml[T,Hq,nch,2].
// attention_decode_reduce_f32: grid (Hq, T), block 128; merges the chunks a token really has.
// attention_prefill_*: grid (ceil(T/BQ), Hq), block 128, dynamic smem (D*33 + BQ*D) * 4 bytes.
//   BQ = 16 query tokens of one head per block (8 when D > 128), online softmax over 32-key
//   tiles: a lane per key for q.k (K tile transposed in shared memory), lanes over D for p.v.
//   The tile's tokens are grouped by sequence in-kernel, so mixed batches and chunked prefill
//   over a cached prefix need no host-side layout. A sequence's key tiles start at the tile of
//   the earliest window start among the block's rows.
// Needs: D <= 256; D*rep <= 4096 (decode). Softmax uses expf, not __expf, to stay close to ref.
// Non-finite scores as ref (the rule in attention.py): fmaxf skips a NaN score, whose expf is
// NaN, so the row's sum is NaN; a max of -inf (every score so far -inf) shifts by 0, not by
// itself (expf(-inf - -inf) is NaN): those weights are 0 and a later finite key still counts.
#include "gemv_common.cuh"

#define ATT_THREADS 128
#define KEY_TILE 32  // keys per prefill tile: one per lane

// The first position a token at p reads: its window's start, 0 without a window (W = 0).
__device__ __forceinline__ int window_start(int p, int W) { return W > 0 ? max(0, p - W + 1) : 0; }
// Key j is visible to a query at position p: causal, and inside the window when there is one.
// (Not written as j >= window_start(p, W): that form took the prefill kernels from 72 to 77-79
// registers on sm_90, cuda/launch_limits.json, 2026-12-07.)
__device__ __forceinline__ bool visible(int j, int p, int W) {
  return j <= p && (W <= 0 || j > p - W);
}

// ---------------------------------------------------------------- decode (one token per sequence)
// Scores sp[h*CH + j] = scale * q_h . k_j for the chunk; a thread per key, heads in groups of 4.
template <typename KV>
__device__ void decode_scores(const KV* kc, const float* sq, float* sp, const int* sslot, int len,
                              int rep, int G, int g, int D, int CH, float scale) {
  const bool vec = (D & 7) == 0 && aligned16(kc);
  for (int j = threadIdx.x; j < len; j += ATT_THREADS) {
    const KV* krow = kc + ((size_t)sslot[j] * G + g) * D;
    for (int h0 = 0; h0 < rep; h0 += 4) {  // the K row is re-read per 4 heads, from L1
      float acc[4] = {0.f, 0.f, 0.f, 0.f}, kv[8];
      for (int d = 0; d < D; d += 8) {
        if (vec) load8(krow + d, kv);
        else load8_n(krow + d, D - d, kv);
#pragma unroll
        for (int hh = 0; hh < 4; ++hh)
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (h0 + hh < rep && d + i < D) acc[hh] += sq[(h0 + hh) * D + d + i] * kv[i];
      }
      for (int hh = 0; hh < 4 && h0 + hh < rep; ++hh) sp[(h0 + hh) * CH + j] = acc[hh] * scale;
    }
  }
}

// Per head (a warp each): m = max score, p = exp(s - m) in place, l = sum p -> part_ml.
__device__ void decode_softmax(float* sp, float* ml, int len, int rep, int CH, int nch) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int h = warp; h < rep; h += ATT_THREADS / 32) {
    float* s = sp + h * CH;
    float m = neg_inf();
    for (int j = lane; j < len; j += 32) m = fmaxf(m, s[j]);
    m = warp_allmax(m);
    const float base = m == neg_inf() ? 0.f : m;  // all -inf: p and l 0 (all chunks so: NaN)
    float l = 0.f;
    for (int j = lane; j < len; j += 32) s[j] = expf(s[j] - base), l += s[j];
    l = warp_sum(l);
    if (lane == 0) ml[(size_t)h * nch * 2] = m, ml[(size_t)h * nch * 2 + 1] = l;
  }
}

// o[h][d] = sum_j p[h][j] * v_j[d]; a thread per (h, d) output, consecutive threads on
// consecutive d (coalesced V reads; the rep heads re-read a row from L1).
template <typename KV>
__device__ void decode_values(const KV* vc, const float* sp, const int* sslot, int len, int rep,
                              int G, int g, int D, int CH, int nch, float* po) {
  for (int o = threadIdx.x; o < rep * D; o += ATT_THREADS) {
    const int h = o / D, d = o - h * D;
    const float* p = sp + h * CH;
    float acc = 0.f;
    for (int j = 0; j < len; ++j) acc += p[j] * to_f32(vc[((size_t)sslot[j] * G + g) * D + d]);
    po[(size_t)h * nch * D + d] = acc;
  }
}

template <typename KV>
__device__ void decode_impl(const float* q, const KV* kc, const KV* vc, const int* slot_table,
                            const int* tok_seq, const int* tok_pos, float scale, float* part_o,
                            float* part_ml, int Hq, int G, int D, int C, int CH, int nch,
                            int window) {
  extern __shared__ __align__(16) float smem[];
  const int c = blockIdx.x, g = blockIdx.y, t = blockIdx.z, rep = Hq / G;
  const int n = tok_pos[t] + 1, k0 = window_start(tok_pos[t], window) + c * CH;
  if (k0 >= n) return;  // past this token's context: the reduce never reads this chunk
  const int len = min(CH, n - k0);
  float* sq = smem;                          // [rep][D] the group's queries
  float* sp = sq + rep * D;                  // [rep][CH] scores, then probabilities
  int* sslot = (int*)(sp + rep * CH);        // [CH] KV slots of the chunk
  const int* row = slot_table + (size_t)tok_seq[t] * C + k0;
  const float* qg = q + ((size_t)t * Hq + g * rep) * D;  // the group's rep heads are adjacent
  for (int i = threadIdx.x; i < rep * D; i += ATT_THREADS) sq[i] = qg[i];
  for (int j = threadIdx.x; j < len; j += ATT_THREADS) sslot[j] = row[j];
  __syncthreads();
  decode_scores(kc, sq, sp, sslot, len, rep, G, g, D, CH, scale);
  __syncthreads();
  const size_t head0 = (size_t)t * Hq + g * rep;  // [T,Hq] index of the group's first head
  decode_softmax(sp, part_ml + (head0 * nch + c) * 2, len, rep, CH, nch);
  __syncthreads();
  decode_values(vc, sp, sslot, len, rep, G, g, D, CH, nch, part_o + (head0 * nch + c) * D);
}

extern "C" __global__ void attention_decode_reduce_f32(const float* part_o, const float* part_ml,
                                                       const int* tok_pos, const float* sinks,
                                                       float* out, int Hq, int D, int CH, int nch,
                                                       int window, int use_sinks) {
  const int h = blockIdx.x, t = blockIdx.y, f = window_start(tok_pos[t], window);
  const int used = min(nch, (tok_pos[t] - f + CH) / CH);  // chunks holding positions f..tok_pos[t]
  const float* ml = part_ml + ((size_t)t * Hq + h) * nch * 2;
  const float* po = part_o + ((size_t)t * Hq + h) * nch * D;
  float m = use_sinks ? sinks[h] : neg_inf(), l = 0.f;
  for (int c = 0; c < used; ++c) m = fmaxf(m, ml[2 * c]);
  for (int c = 0; c < used; ++c) l += ml[2 * c + 1] * expf(ml[2 * c] - m);
  if (use_sinks) l += expf(sinks[h] - m);  // the sink's weight joins the sum only
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int c = 0; c < used; ++c) acc += expf(ml[2 * c] - m) * po[(size_t)c * D + d];
    out[((size_t)t * Hq + h) * D + d] = acc / l;
  }
}

// ---------------------------------------------------------------- prefill (tiles of query tokens)
// q.k for key j0+lane of the tile against the warp's RPW rows, then the online-softmax update
// of each row: p[r] = exp(s - m_new) (0 for keys past the row's position), l and acc rescaled.
// Rows of another sequence are left alone (warp-uniform test).
template <int EPL, int RPW>
__device__ void prefill_scores(const float* sq, const float* sk, const int* s_seq,
                               const int* s_pos, int seq, int j0, int D, float scale, int window,
                               float (&m)[RPW], float (&l)[RPW], float (&acc)[RPW][EPL],
                               float (&p)[RPW]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float s[RPW] = {};
  for (int d = 0; d < D; ++d) {
    const float kd = sk[d * (KEY_TILE + 1) + lane];
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] += sq[(warp * RPW + r) * D + d] * kd;
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = warp * RPW + r;
    p[r] = 0.f;
    if (s_seq[row] != seq) continue;
    const bool ok = visible(j0 + lane, s_pos[row], window);
    const float mnew = fmaxf(m[r], warp_allmax(ok ? s[r] * scale : neg_inf()));
    const float base = mnew == neg_inf() ? 0.f : mnew;  // all -inf so far: p = 0, not NaN
    const float corr = expf(m[r] - base);  // m = -inf on the first tile: corr = 0, acc and l are 0
    p[r] = ok ? expf(s[r] * scale - base) : 0.f;
    l[r] = l[r] * corr + p[r];  // per-lane partial sum; reduced once at the end
    m[r] = mnew;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[r][e] *= corr;
  }
}

// acc[r] += p_j * v_j over the tile's keys, lanes over D (lane + 32e); key j's probability comes
// from lane j. Keys outside a row's window and rows of another sequence are skipped, not zeroed.
template <typename KV, int EPL, int RPW>
__device__ void prefill_values(const KV* vc, const int* s_seq, const int* s_pos,
                               const int* s_slot, int seq, int j0, int nk, int G, int g, int D,
                               int window, const float (&p)[RPW], float (&acc)[RPW][EPL]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kn = min(KEY_TILE, nk - j0);
  for (int jj = 0; jj < kn; ++jj) {
    const KV* vrow = vc + ((size_t)s_slot[jj] * G + g) * D;
    float v[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) v[e] = lane + 32 * e < D ? to_f32(vrow[lane + 32 * e]) : 0.f;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float pj = __shfl_sync(FULL_MASK, p[r], jj);
      const int row = warp * RPW + r;
      if (s_seq[row] != seq || !visible(j0 + jj, s_pos[row], window)) continue;  // warp-uniform
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[r][e] += pj * v[e];
    }
  }
}

// Stage keys j0..j0+31 of one sequence (row srow of slot_table): slots, then K transposed into
// sk[d][j] (+1 column: the transposed writes and the lane-per-key reads are conflict-free).
template <typename KV>
__device__ void prefill_keys(const KV* kc, const int* srow, int j0, int nk, int G, int g, int D,
                             float* sk, int* s_slot) {
  const int tid = threadIdx.x;
  __syncthreads();  // the previous tile's sk and s_slot are consumed
  if (tid < KEY_TILE) s_slot[tid] = j0 + tid < nk ? srow[j0 + tid] : 0;
  __syncthreads();
  for (int i = tid; i < KEY_TILE * D; i += ATT_THREADS) {
    const int jj = i / D, d = i - jj * D;
    const bool ok = j0 + jj < nk;
    sk[d * (KEY_TILE + 1) + jj] = ok ? to_f32(kc[((size_t)s_slot[jj] * G + g) * D + d]) : 0.f;
  }
  __syncthreads();
}

// Queries of tokens t0..t0+BQ-1 for head h (zeros past T), their sequences and positions (-1
// past T), and the distinct sequences in order with the keys each needs: from the earliest window
// start (s_first) to the max position + 1 (s_nkeys).
template <int BQ>
__device__ void prefill_setup(const float* q, const int* tok_seq, const int* tok_pos, int T,
                              int Hq, int h, int D, int t0, int window, float* sq, int* s_seq,
                              int* s_pos, int* s_uniq, int* s_first, int* s_nkeys, int* s_nuniq) {
  const int tid = threadIdx.x;
  for (int i = tid; i < BQ * D; i += ATT_THREADS) {
    const int t = t0 + i / D;
    sq[i] = t < T ? q[((size_t)t * Hq + h) * D + i % D] : 0.f;
  }
  if (tid < BQ) {
    s_seq[tid] = t0 + tid < T ? tok_seq[t0 + tid] : -1;
    s_pos[tid] = t0 + tid < T ? tok_pos[t0 + tid] : -1;
  }
  __syncthreads();
  if (tid == 0) {
    int nu = 0;
    for (int r = 0; r < BQ; ++r) {
      int u = 0;
      while (u < nu && s_uniq[u] != s_seq[r]) ++u;
      if (s_seq[r] < 0) continue;
      if (u == nu) s_uniq[nu] = s_seq[r], s_nkeys[nu] = 0, s_first[nu++] = s_pos[r];
      s_nkeys[u] = max(s_nkeys[u], s_pos[r] + 1);
      s_first[u] = min(s_first[u], window_start(s_pos[r], window));
    }
    *s_nuniq = nu;
  }
  __syncthreads();
}

template <typename KV, int EPL>
__device__ void prefill_impl(const float* q, const KV* kc, const KV* vc, const int* slot_table,
                             const int* tok_seq, const int* tok_pos, float scale,
                             const float* sinks, float* out, int T, int Hq, int G, int D, int C,
                             int window, int use_sinks) {
  constexpr int RPW = EPL > 4 ? 2 : 4, BQ = 4 * RPW;  // 4 warps x RPW query rows
  extern __shared__ __align__(16) float smem[];
  float* sk = smem;                        // [D][KEY_TILE+1] K tile, transposed
  float* sq = sk + D * (KEY_TILE + 1);     // [BQ][D] queries
  __shared__ int s_seq[BQ], s_pos[BQ], s_uniq[BQ], s_first[BQ], s_nkeys[BQ], s_nuniq,
      s_slot[KEY_TILE];
  const int h = blockIdx.y, g = h / (Hq / G), t0 = blockIdx.x * BQ;
  prefill_setup<BQ>(q, tok_seq, tok_pos, T, Hq, h, D, t0, window, sq, s_seq, s_pos, s_uniq,
                    s_first, s_nkeys, &s_nuniq);
  float m[RPW], l[RPW], acc[RPW][EPL] = {}, p[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) m[r] = neg_inf(), l[r] = 0.f;
  for (int u = 0; u < s_nuniq; ++u) {
    const int seq = s_uniq[u], nk = s_nkeys[u];
    for (int j0 = s_first[u] / KEY_TILE * KEY_TILE; j0 < nk; j0 += KEY_TILE) {
      prefill_keys(kc, slot_table + (size_t)seq * C, j0, nk, G, g, D, sk, s_slot);
      prefill_scores<EPL, RPW>(sq, sk, s_seq, s_pos, seq, j0, D, scale, window, m, l, acc, p);
      prefill_values<KV, EPL, RPW>(vc, s_seq, s_pos, s_slot, seq, j0, nk, G, g, D, window, p,
                                   acc);
    }
  }
  const int lane = threadIdx.x & 31, row0 = (threadIdx.x >> 5) * RPW;
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    float total = warp_allsum(l[r]), keep = 1.f;
    const int t = t0 + row0 + r;
    if (t >= T) continue;
    if (use_sinks) {  // the sink's logit joins the max and the sum; its weight is dropped
      const float mnew = fmaxf(m[r], sinks[h]);
      keep = expf(m[r] - mnew);  // no key so far (m = -inf): 0, and acc is 0
      total = total * keep + expf(sinks[h] - mnew);
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e)
      if (lane + 32 * e < D)
        out[((size_t)t * Hq + h) * D + lane + 32 * e] = acc[r][e] * keep / total;
  }
}

// D is a run-time value: one instance per elements-per-lane count ceil(D/32) (registers acc[EPL]).
#define PREFILL_CASE(n) \
  case n: prefill_impl<KV, n>(q, kc, vc, st, ts, tp, scale, sinks, out, T, Hq, G, D, C, window, \
                             use_sinks); break;
template <typename KV>
__device__ void prefill_dispatch(const float* q, const KV* kc, const KV* vc, const int* st,
                                 const int* ts, const int* tp, float scale, const float* sinks,
                                 float* out, int T, int Hq, int G, int D, int C, int window,
                                 int use_sinks) {
  switch ((D + 31) / 32) {
    PREFILL_CASE(1) PREFILL_CASE(2) PREFILL_CASE(3) PREFILL_CASE(4)
    PREFILL_CASE(5) PREFILL_CASE(6) PREFILL_CASE(7) PREFILL_CASE(8)
    default: break;  // the wrapper rejects D > 256
  }
}

extern "C" __global__ void attention_decode_bf16(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache,
    const int* slot_table, const int* tok_seq, const int* tok_pos, float scale, float* part_o,
    float* part_ml, int Hq, int G, int D, int C, int CH, int nch, int window) {
  decode_impl(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, part_o, part_ml, Hq, G,
              D, C, CH, nch, window);
}

extern "C" __global__ void attention_decode_f32(
    const float* q, const float* k_cache, const float* v_cache,
    const int* slot_table, const int* tok_seq, const int* tok_pos, float scale, float* part_o,
    float* part_ml, int Hq, int G, int D, int C, int CH, int nch, int window) {
  decode_impl(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, part_o, part_ml, Hq, G,
              D, C, CH, nch, window);
}

extern "C" __global__ void attention_prefill_bf16(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache,
    const int* slot_table, const int* tok_seq, const int* tok_pos, float scale,
    const float* sinks, float* out, int T, int Hq, int G, int D, int C, int window,
    int use_sinks) {
  prefill_dispatch(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, sinks, out, T, Hq,
                   G, D, C, window, use_sinks);
}

extern "C" __global__ void attention_prefill_f32(
    const float* q, const float* k_cache, const float* v_cache,
    const int* slot_table, const int* tok_seq, const int* tok_pos, float scale,
    const float* sinks, float* out, int T, int Hq, int G, int D, int C, int window,
    int use_sinks) {
  prefill_dispatch(q, k_cache, v_cache, slot_table, tok_seq, tok_pos, scale, sinks, out, T, Hq,
                   G, D, C, window, use_sinks);
}
