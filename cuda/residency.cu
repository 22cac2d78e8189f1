// residency.cu -- the expert cache's residency step (docs/design.md, The residency step) and the
// copies that feed the slot pool.
// Wrapper: freetoken/moe/residency_gpu.py   Spec: freetoken/moe/residency.py (SlotCache.step)
// Tests: tests/moe/test_gpu_residency.py (bit for bit against the spec over long random runs).
//
// State (device): slot_for i32[L*E] (slot or -1), owner_of i32[S] (flat id layer*E+expert or -1),
// usage i64[S] (clock of last touch), recency i64[L*E] (clock last routed, -1 never), clock i64[1],
// counters i64[L*5] (hits, misses, fills, cpu_execs, evictions per layer).
//
// residency_step_i32: ONE block of RES_THREADS threads per MoE layer call, the eight parts in
//   order with a barrier between phases. A single block because the victim scan must see this
//   step's hit bumps (docs/design.md, Hazards: hit bumps before the victim scan) and the fills
//   are a sequence of dependent argmins.
//   q = min(policy count, S - hits): any S >= 1 works, the unfetched misses go to the CPU.
//   Dynamic shared memory: 3*E ints (routed flags, misses as found, misses in fill order).
// residency_invalidate_i32: slots [lo, hi) become empty and coldest (usage 0); used when prefill
//   borrows them. Any grid.
// residency_count_i32: one block; adds the number of distinct routed experts to one or two counter
//   columns (fused: hits; cpu: misses and cpu_execs), so every backend's counters stay on device.
// fill_rows_*: grid (COPY_BLOCKS,); the first min(*fill_count, rows) rows of the fill plan, host
//   bank (mapped pinned memory, read over the link) -> slot. The count is read on the device, so
//   the launch is sized without reading the plan (graph-capture safe).
// prefill_load_*: grid (COPY_BLOCKS,); experts [0, rows) of a layer -> slots [dst0, dst0 + rows);
//   an expert resident in a slot >= keep_lo is copied device to device instead of over the link.
#include "common.cuh"

#define RES_THREADS 256
#define Q16 65536LL
#define NUM_COUNTERS 5

enum { C_HITS = 0, C_MISSES = 1, C_FILLS = 2, C_CPU = 3, C_EVICT = 4 };
enum { KIND_FRACTION = 0, KIND_CAP = 1, KIND_ALL = 2 };
enum { ORDER_RECENCY = 0, ORDER_LOWEST_ID = 1 };

__device__ __forceinline__ long long lmax(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long lmin(long long a, long long b) { return a < b ? a : b; }

// split.py fetch_count / FetchPolicy.count in the same integers: makespan argmin, ties -> fewer.
__device__ long long split_cost(long long f, long long m, long long frac) {
  return lmax(f * (Q16 - frac), (m - f) * frac);
}

__device__ int policy_count(int m, int kind, int frac, int cap, int min_fill) {
  long long q = m;
  if (kind == KIND_FRACTION) {
    const long long lo = ((long long)m * frac) >> 16;
    q = split_cost(lo, m, frac) <= split_cost(lo + 1, m, frac) ? lo : lo + 1;
    q = lmin(q, m);
  } else if (kind == KIND_CAP) {
    q = lmin(m, cap);
  }
  if (min_fill && m > 0) q = lmax(q, 1);
  return (int)q;
}

// Fill order of two misses: recency descending then lower id, or lower id alone.
__device__ __forceinline__ bool fills_first(int a, int b, const long long* rec, int order) {
  if (order == ORDER_RECENCY && rec[a] != rec[b]) return rec[a] > rec[b];
  return a < b;
}

// A slot this layer-step must not evict: owned by an expert routed at this layer in this step.
// Fills link their victim to a routed expert, so a filled slot becomes protected by this test too.
__device__ __forceinline__ bool protected_slot(int s, const int* owner_of, const int* routed,
                                               int layer, int E) {
  const int o = owner_of[s];
  return o >= 0 && o / E == layer && routed[o % E];
}

struct Victim { long long usage; int slot; };  // slot < 0: none

__device__ __forceinline__ Victim colder(Victim a, Victim b) {
  if (a.slot < 0) return b;
  if (b.slot < 0) return a;
  return (b.usage < a.usage || (b.usage == a.usage && b.slot < a.slot)) ? b : a;
}

// This thread's coldest unprotected slot among s = tid, tid + blockDim, ...
__device__ Victim local_coldest(const long long* usage, const int* owner_of, const int* routed,
                                int layer, int E, int S) {
  Victim v = {0, -1};
  for (int s = threadIdx.x; s < S; s += blockDim.x)
    if (!protected_slot(s, owner_of, routed, layer, E)) v = colder(v, Victim{usage[s], s});
  return v;
}

// Every thread gets the block's coldest; the trailing barrier makes `scratch` reusable.
__device__ Victim block_coldest(Victim v, Victim* scratch) {
  for (int o = WARP / 2; o > 0; o >>= 1) {
    Victim w = {__shfl_xor_sync(FULL_MASK, v.usage, o), __shfl_xor_sync(FULL_MASK, v.slot, o)};
    v = colder(v, w);
  }
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  Victim r = scratch[0];
  for (int w = 1; w < (int)(blockDim.x / WARP); ++w) r = colder(r, scratch[w]);
  __syncthreads();
  return r;
}

// Part 5: the q victims are the q coldest unprotected slots, taken one at a time. Only the thread
// whose stride holds the last victim rescans. Thread 0 links; returns fills done and counts
// evictions. The caller bounds q by the S - hits unprotected slots, so a victim always exists;
// the break only keeps an inconsistent state from linking slot -1.
__device__ int take_victims(int q, const int* fill_order, int layer, int E, int S, long long now,
                            int* slot_for, int* owner_of, long long* usage, const int* routed,
                            int* fill_slots, int* fill_experts, int* evictions) {
  __shared__ Victim scratch[MAX_WARPS];
  Victim mine = local_coldest(usage, owner_of, routed, layer, E, S);
  int done = 0;
  for (; done < q; ++done) {
    const Victim best = block_coldest(mine, scratch);
    if (best.slot < 0) break;  // uniform: every thread holds the same best
    if (threadIdx.x == 0) {
      const int e = fill_order[done], old = owner_of[best.slot];
      if (old >= 0) slot_for[old] = -1, ++*evictions;
      owner_of[best.slot] = layer * E + e;
      slot_for[layer * E + e] = best.slot;
      usage[best.slot] = now;
      fill_slots[done] = best.slot;
      fill_experts[done] = e;
    }
    __syncthreads();
    if (best.slot % (int)blockDim.x == (int)threadIdx.x)
      mine = local_coldest(usage, owner_of, routed, layer, E, S);
  }
  return done;
}

extern "C" __global__ void __launch_bounds__(RES_THREADS) residency_step_i32(
    int* ids, int* cpu_ids, int P, int layer, int E, int S, int* slot_for, int* owner_of,
    long long* usage, long long* recency, long long* clock, long long* counters,
    int* fill_slots, int* fill_experts, int* fill_count, int kind, int frac_q16, int cap,
    int min_fill, int order) {
  extern __shared__ int smem[];
  int *routed = smem, *found = smem + E, *fill_order = smem + 2 * E;
  __shared__ long long s_now;
  __shared__ int s_misses, s_hits;
  const int tid = threadIdx.x, base = layer * E;
  long long* rec = recency + base;
  for (int e = tid; e < E; e += blockDim.x) routed[e] = 0;
  if (tid == 0) s_now = *clock + 1, *clock = s_now, s_misses = 0, s_hits = 0;  // part 1
  __syncthreads();
  for (int p = tid; p < P; p += blockDim.x)  // the distinct routed experts (order is irrelevant:
    if (ids[p] >= 0 && ids[p] < E) atomicOr(&routed[ids[p]], 1);  // the fill order below is total)
  __syncthreads();
  const long long now = s_now;
  for (int e = tid; e < E; e += blockDim.x) {  // part 2: hits; misses collected
    if (!routed[e]) continue;
    const int s = slot_for[base + e];
    if (s >= 0) usage[s] = now, atomicAdd(&s_hits, 1);
    else found[atomicAdd(&s_misses, 1)] = e;
  }
  __syncthreads();  // the hit bumps are visible to the victim scan (docs/design.md, Hazards)
  const int m = s_misses;
  for (int i = tid; i < m; i += blockDim.x) {  // part 3: rank of each miss in fill order
    int rank = 0;
    for (int j = 0; j < m; ++j) rank += fills_first(found[j], found[i], rec, order);
    fill_order[rank] = found[i];
  }
  __syncthreads();
  // Part 4, bounded by the evictable slots: each hit pins one slot, so at most S - hits fills fit
  // (any S works; the misses left over run on the CPU).
  const int q = (int)lmin(policy_count(m, kind, frac_q16, cap, min_fill), S - s_hits);
  int evictions = 0;
  const int done = take_victims(q, fill_order, layer, E, S, now, slot_for, owner_of, usage,
                                routed, fill_slots, fill_experts, &evictions);  // part 5
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x)
    if (routed[e]) rec[e] = now;  // part 6
  for (int p = tid; p < P; p += blockDim.x) {  // part 7: slot, or -1 and the expert to the CPU
    const int e = ids[p], s = (e >= 0 && e < E) ? slot_for[base + e] : -1;
    cpu_ids[p] = (s < 0 && e >= 0 && e < E) ? e : -1;
    ids[p] = s;
  }
  if (tid == 0) {  // part 8
    long long* c = counters + (long long)layer * NUM_COUNTERS;
    c[C_HITS] += s_hits, c[C_MISSES] += m, c[C_FILLS] += done, c[C_CPU] += m - done;
    c[C_EVICT] += evictions;
    *fill_count = done;
  }
}

extern "C" __global__ void residency_invalidate_i32(int* slot_for, int* owner_of, long long* usage,
                                                    int lo, int hi) {
  for (int s = lo + blockIdx.x * blockDim.x + threadIdx.x; s < hi; s += gridDim.x * blockDim.x) {
    const int o = owner_of[s];
    if (o >= 0) slot_for[o] = -1;
    owner_of[s] = -1;
    usage[s] = 0;
  }
}

extern "C" __global__ void residency_count_i32(const int* ids, int P, int layer, int E,
                                               long long* counters, int col_a, int col_b) {
  extern __shared__ int smem[];
  __shared__ int scratch[MAX_WARPS];
  for (int e = threadIdx.x; e < E; e += blockDim.x) smem[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x)
    if (ids[p] >= 0 && ids[p] < E) atomicOr(&smem[ids[p]], 1);   // many threads, one expert: no race
  __syncthreads();
  int n = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) n += smem[e];
  n = block_sum(n, scratch);
  if (threadIdx.x == 0) {
    long long* c = counters + (long long)layer * NUM_COUNTERS;
    c[col_a] += n;
    if (col_b >= 0) c[col_b] += n;
  }
}

// The copies run on the copy stream next to compute kernels, so they use a small fixed grid
// (the wrapper's COPY_BLOCKS): a few dozen blocks with several 16-byte loads in flight per thread
// keep a PCIe link busy, and the remaining SM slots stay free for the compute stream.
// Work item w = (row, bank, chunk): the block copies chunk `chunk` of 'chunks' of that row.
#define COPY_UNROLL 4

// Elements [i0, i1) of a row with the whole block: 16-byte vectors when both ends and the bounds
// allow (the link is only saturated by wide loads), else element-wise.
template <typename T>
__device__ void copy_span(T* dst, const T* src, long long i0, long long i1) {
  const unsigned long long ends = (unsigned long long)(dst + i0) | (unsigned long long)(src + i0);
  const bool wide = (ends & 15ull) == 0 && ((i1 - i0) * (long long)sizeof(T)) % 16 == 0;
  if (!wide) {
    for (long long i = i0 + threadIdx.x; i < i1; i += blockDim.x) dst[i] = src[i];
    return;
  }
  uint4* d = reinterpret_cast<uint4*>(dst + i0);
  const uint4* s = reinterpret_cast<const uint4*>(src + i0);
  const long long n = (i1 - i0) * (long long)sizeof(T) / 16;
  for (long long base = 0; base < n; base += (long long)blockDim.x * COPY_UNROLL) {
    uint4 r[COPY_UNROLL];
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; ++u) {  // all loads first: COPY_UNROLL requests in flight
      const long long i = base + u * (long long)blockDim.x + threadIdx.x;
      if (i < n) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; ++u) {
      const long long i = base + u * (long long)blockDim.x + threadIdx.x;
      if (i < n) d[i] = r[u];
    }
  }
}

// Chunk `chunk` of `chunks` of a row of n elements; chunk bounds are 16-byte aligned (8 bf16 or
// f32 elements, 16 bytes of blocks), so chunks keep 16-byte alignment whenever the row does.
template <typename T>
__device__ void copy_chunk(T* dst, const T* src, long long n, int chunk, int chunks) {
  const long long align = sizeof(T) == 1 ? 16 : 8;
  const long long per = ((n + chunks - 1) / chunks + align - 1) / align * align;
  const long long i0 = per * chunk, i1 = i0 + per < n ? i0 + per : n;
  if (i0 < i1) copy_span(dst, src, i0, i1);
}

// Rows: an expert's gate_up (gu_row elements) and down (dn_row). A host bank holds its experts
// back to back; slot s of the pool starts at s * gu_slot / s * dn_slot (>= the row: a quantized
// pool shared by layers of several formats is as wide as the largest layer's expert).
template <typename T>
__device__ void fill_rows_impl(const T* host_gate_up, const T* host_down, T* pool_gate_up,
                               T* pool_down, const int* fill_slots, const int* fill_experts,
                               const int* fill_count, int rows, int chunks, long long gu_row,
                               long long dn_row, long long gu_slot, long long dn_slot) {
  const int count = *fill_count < rows ? *fill_count : rows;
  for (int w = blockIdx.x; w < count * 2 * chunks; w += gridDim.x) {
    const int i = w / (2 * chunks), bank = (w / chunks) % 2, chunk = w % chunks;
    const long long e = fill_experts[i], s = fill_slots[i];
    if (bank == 0)
      copy_chunk(pool_gate_up + s * gu_slot, host_gate_up + e * gu_row, gu_row, chunk, chunks);
    else
      copy_chunk(pool_down + s * dn_slot, host_down + e * dn_row, dn_row, chunk, chunks);
  }
}

template <typename T>
__device__ void prefill_load_impl(const T* host_gate_up, const T* host_down, T* pool_gate_up,
                                  T* pool_down, const int* slot_for_layer, int rows, int chunks,
                                  int dst0, int keep_lo, long long gu_row, long long dn_row,
                                  long long gu_slot, long long dn_slot) {
  for (int w = blockIdx.x; w < rows * 2 * chunks; w += gridDim.x) {
    const int e = w / (2 * chunks), bank = (w / chunks) % 2, chunk = w % chunks;
    const long long s = slot_for_layer[e], d = dst0 + e;
    const bool resident = s >= keep_lo;  // a slot outside the borrowed range keeps a valid copy
    if (bank == 0) {
      const T* src = resident ? pool_gate_up + s * gu_slot : host_gate_up + e * gu_row;
      copy_chunk(pool_gate_up + d * gu_slot, src, gu_row, chunk, chunks);
    } else {
      const T* src = resident ? pool_down + s * dn_slot : host_down + e * dn_row;
      copy_chunk(pool_down + d * dn_slot, src, dn_row, chunk, chunks);
    }
  }
}

// one pair of entries per storage type: bf16 bits, f32, and u8 (quantized blocks); written out,
// not generated by a macro, since the emulator and the signature test read the entries from the text
extern "C" __global__ void fill_rows_bf16(
    const u16* host_gate_up, const u16* host_down, u16* pool_gate_up, u16* pool_down,
    const int* fill_slots, const int* fill_experts, const int* fill_count, int rows, int chunks,
    long long gu_row, long long dn_row, long long gu_slot, long long dn_slot) {
  fill_rows_impl(host_gate_up, host_down, pool_gate_up, pool_down, fill_slots, fill_experts,
                 fill_count, rows, chunks, gu_row, dn_row, gu_slot, dn_slot);
}

extern "C" __global__ void prefill_load_bf16(
    const u16* host_gate_up, const u16* host_down, u16* pool_gate_up, u16* pool_down,
    const int* slot_for_layer, int rows, int chunks, int dst0, int keep_lo, long long gu_row,
    long long dn_row, long long gu_slot, long long dn_slot) {
  prefill_load_impl(host_gate_up, host_down, pool_gate_up, pool_down, slot_for_layer, rows,
                    chunks, dst0, keep_lo, gu_row, dn_row, gu_slot, dn_slot);
}

extern "C" __global__ void fill_rows_f32(
    const float* host_gate_up, const float* host_down, float* pool_gate_up, float* pool_down,
    const int* fill_slots, const int* fill_experts, const int* fill_count, int rows, int chunks,
    long long gu_row, long long dn_row, long long gu_slot, long long dn_slot) {
  fill_rows_impl(host_gate_up, host_down, pool_gate_up, pool_down, fill_slots, fill_experts,
                 fill_count, rows, chunks, gu_row, dn_row, gu_slot, dn_slot);
}

extern "C" __global__ void prefill_load_f32(
    const float* host_gate_up, const float* host_down, float* pool_gate_up, float* pool_down,
    const int* slot_for_layer, int rows, int chunks, int dst0, int keep_lo, long long gu_row,
    long long dn_row, long long gu_slot, long long dn_slot) {
  prefill_load_impl(host_gate_up, host_down, pool_gate_up, pool_down, slot_for_layer, rows,
                    chunks, dst0, keep_lo, gu_row, dn_row, gu_slot, dn_slot);
}

extern "C" __global__ void fill_rows_u8(
    const unsigned char* host_gate_up, const unsigned char* host_down, unsigned char* pool_gate_up, unsigned char* pool_down,
    const int* fill_slots, const int* fill_experts, const int* fill_count, int rows, int chunks,
    long long gu_row, long long dn_row, long long gu_slot, long long dn_slot) {
  fill_rows_impl(host_gate_up, host_down, pool_gate_up, pool_down, fill_slots, fill_experts,
                 fill_count, rows, chunks, gu_row, dn_row, gu_slot, dn_slot);
}

extern "C" __global__ void prefill_load_u8(
    const unsigned char* host_gate_up, const unsigned char* host_down, unsigned char* pool_gate_up, unsigned char* pool_down,
    const int* slot_for_layer, int rows, int chunks, int dst0, int keep_lo, long long gu_row,
    long long dn_row, long long gu_slot, long long dn_slot) {
  prefill_load_impl(host_gate_up, host_down, pool_gate_up, pool_down, slot_for_layer, rows,
                    chunks, dst0, keep_lo, gu_row, dn_row, gu_slot, dn_slot);
}
