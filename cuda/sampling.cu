// sampling.cu -- one token per row from logits: greedy when temperature <= 0, else softmax at
// 1/temperature, top-k, top-p, min-p, renormalise, inverse CDF at the row's given uniform.
// Wrapper: freetoken/kernels/sampling.py   Spec: sampling.ref   Test: tests/kernels/test_gpu_sampling.py
// Launch: grid (B,), block (threads(V) <= 1024,); one block per row, no scratch memory.
// Needs: logits [B,V] and the per-row parameter arrays [B] C-contiguous. Non-finite rows: greedy
// reads NaN as -inf; a sampled row with a NaN or +inf scaled logit, or all -inf, takes its greedy
// token (sampling.ref's rule), so the id is always in [0, V).
//
// Sort-free. Tokens are ordered by e = exp(z/T - max) descending, ties by lower id. Every filter
// keeps a prefix of that order, so each is a "cut": the last kept (value bits, id); a token is
// kept iff (bits > cut.v) or (bits == cut.v and id <= cut.id). e >= 0, so the order of e is the
// order of its bits as unsigned ints, and e <= 1 (the maximum is exp(0) = 1 exactly). Cuts are
// found by binary search over the bits (count or mass of tokens above a threshold, one block
// reduction over the row per step), then over ids among the tokens tied at the cut value:
//   top_k: largest v with count(bits >= v) >= k, then the (k - count(bits > v))-th tied id.
//   top_p: smallest v with mass(kept_k, bits > v) < top_p * mass(kept_k); token i stays while
//          the mass before it is < that, so ceil((P - mass above) / v) of the ties stay.
//   min_p: e >= min_p (the maximum is 1, so no division); the zero-probability drop: e > 0.
//   pick:  smallest v with mass(kept, bits > v) <= u * mass(kept): the token is tied at v, at
//          tie index floor((u * mass(kept) - mass above) / v) in id order.
// About 150 passes over the row when every filter is on; rows run on separate SMs. The recipe
// was checked against sampling.ref in numpy before it was written in CUDA.
// Numerics: the products z * (1/T) are rounded like numpy's (no FMA contraction); masses are
// fp32 block-tree sums where ref uses sequential cumsums, so a uniform within ~1e-6 of a CDF
// step may pick the neighbouring token. CuPy compiles with -ftz=true, so an e below 2^-126
// (a scaled logit ~87 under the max) counts as probability 0, where ref keeps a vanishing mass.
// min_p > 1 is treated as 1 (the top token always stays).
// mask_logits_f32 (constrained decoding, launched before sampling_f32 only when a mask is given):
// grid (B,), block (threads(W),); logits [B,V] in place (the wrapper's copy), mask int32 [B,W],
// W = ceil(V/32): bit t&31 of word t>>5 clear -> logit t = -inf. All-ones words are skipped, so
// an unconstrained row (all -1) is only read. -inf logits give e = 0: greedy never picks them
// while one allowed token exists, and every sampling filter drops them as probability 0.
#include "common.cuh"

#define ONE_BITS 0x3f800000u  // bits of 1.0f, the largest e

struct Row { const float* z; int V; float inv_t; float m; };
struct Cut { u32 v; int id; };
struct Scratch { float f[MAX_WARPS]; int i[MAX_WARPS]; ArgMax am[MAX_WARPS]; };

__device__ __forceinline__ bool keeps(Cut c, u32 b, int i) { return b > c.v || (b == c.v && i <= c.id); }

__device__ __forceinline__ float row_e(const Row& r, int i) {
    return expf(__fsub_rn(__fmul_rn(r.z[i], r.inv_t), r.m));
}

// sum over the row of f(i, e, bits) (float), or the count of tokens where f is true (int)
template <typename F>
__device__ float row_sum(const Row& r, F f, Scratch& s) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < r.V; i += blockDim.x) {
        const float e = row_e(r, i);
        acc += f(i, e, __float_as_uint(e));
    }
    return block_sum(acc, s.f);
}

template <typename F>
__device__ int row_count(const Row& r, F f, Scratch& s) {
    int acc = 0;
    for (int i = threadIdx.x; i < r.V; i += blockDim.x) {
        const float e = row_e(r, i);
        acc += f(i, e, __float_as_uint(e)) ? 1 : 0;
    }
    return block_sum(acc, s.i);
}

// smallest t in [lo, hi] with pred(t), pred monotone false..true; hi when none is true.
// pred is a block reduction, so every thread takes the same branch.
template <typename T, typename P>
__device__ T min_true(T lo, T hi, P pred) {
    while (lo < hi) {
        const T mid = lo + (hi - lo) / 2;
        if (pred(mid)) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// largest t in [lo, hi] with pred(t), pred monotone true..false and pred(lo) true
template <typename T, typename P>
__device__ T max_true(T lo, T hi, P pred) {
    while (lo < hi) {
        const T mid = lo + (hi - lo + 1) / 2;
        if (pred(mid)) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// the id of the n-th (1-based) member in id order; V - 1 when there are fewer than n
template <typename M>
__device__ int nth_id(const Row& r, M member, int n, Scratch& s) {
    return min_true(0, r.V - 1, [&](int x) {
        return row_count(r, [=](int i, float e, u32 b) { return i <= x && member(i, e, b); }, s) >= n;
    });
}

__device__ Cut top_k_cut(const Row& r, int k, Scratch& s) {
    const u32 v = max_true(0u, ONE_BITS, [&](u32 t) {
        return row_count(r, [=](int, float, u32 b) { return b >= t; }, s) >= k;
    });
    const int above = row_count(r, [=](int, float, u32 b) { return b > v; }, s);
    const int id = nth_id(r, [=](int, float, u32 b) { return b == v; }, k - above, s);
    return {v, id};
}

__device__ Cut top_p_cut(const Row& r, Cut ck, float top_p, Scratch& s) {
    auto mass_above = [&](u32 t) {
        return row_sum(r, [=](int i, float e, u32 b) { return keeps(ck, b, i) && b > t ? e : 0.0f; }, s);
    };
    const float P = top_p * row_sum(r, [=](int i, float e, u32 b) { return keeps(ck, b, i) ? e : 0.0f; }, s);
    const u32 v = min_true(0u, ONE_BITS, [&](u32 t) { return mass_above(t) < P; });
    if (v == 0u) return {0u, r.V - 1};  // every positive token is needed to reach P
    const float need = fmaxf(1.0f, ceilf((P - mass_above(v)) / __uint_as_float(v)));
    const int n = need >= (float)r.V ? r.V : (int)need;
    return {v, nth_id(r, [=](int, float, u32 b) { return b == v; }, n, s)};
}

// the first kept token, in order, whose cumulative kept mass exceeds u * (total kept mass)
template <typename K>
__device__ int inverse_cdf(const Row& r, K kept, float u, Scratch& s) {
    auto mass_above = [&](u32 t) {
        return row_sum(r, [=](int i, float e, u32 b) { return kept(i, e, b) && b > t ? e : 0.0f; }, s);
    };
    const float U = u * mass_above(0u);  // kept tokens all have e > 0
    const u32 v = min_true(0u, ONE_BITS, [&](u32 t) { return mass_above(t) <= U; });
    if (v == 0u) {  // rounding put U at the total: the last kept token (lowest e, highest id)
        ArgMax last = {0.0f, -1};
        for (int i = threadIdx.x; i < r.V; i += blockDim.x) {
            const float e = row_e(r, i);
            if (kept(i, e, __float_as_uint(e))) last = better(last, ArgMax{-e, r.V - 1 - i});
        }
        return r.V - 1 - block_argmax(last, s.am).i;
    }
    auto tied = [=](int i, float e, u32 b) { return b == v && kept(i, e, b); };
    const float j = floorf((U - mass_above(v)) / __uint_as_float(v));
    const int ties = row_count(r, tied, s);
    const int n = j >= (float)(ties - 1) ? ties : (int)j + 1;
    return nth_id(r, tied, n, s);
}

// argmax with NaN read as -inf (sampling.ref's rule), ties to the lowest id
__device__ int greedy(const float* z, int V, Scratch& s) {
    ArgMax best = {neg_inf(), -1};
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        best = better(best, ArgMax{isnan(z[i]) ? neg_inf() : z[i], i});
    return block_argmax(best, s.am).i;
}

extern "C" __global__ void mask_logits_f32(float* logits, const int* mask, int B, int W, int V) {
    const int row = blockIdx.x;
    if (row >= B) return;
    float* z = logits + (long long)row * V;
    const int* m = mask + (long long)row * W;
    for (int w = threadIdx.x; w < W; w += blockDim.x) {
        const u32 word = (u32)m[w];
        if (word == 0xffffffffu) continue;
        const int base = w * 32, top = min(32, V - base);
        for (int j = 0; j < top; ++j)
            if (!((word >> j) & 1u)) z[base + j] = neg_inf();
    }
}

extern "C" __global__ void sampling_f32(const float* logits, const float* temperature,
                                        const int* top_k, const float* top_p, const float* min_p,
                                        const float* uniforms, int* out, int B, int V) {
    __shared__ Scratch s;
    const int row = blockIdx.x;
    if (row >= B) return;
    const float* z = logits + (long long)row * V;
    const float temp = temperature[row];
    int token;
    if (!(temp > 0.0f)) {
        token = greedy(z, V, s);
    } else {
        Row r = {z, V, 1.0f / temp, neg_inf()};
        float m = neg_inf();
        int nan_seen = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float zi = __fmul_rn(z[i], r.inv_t);
            m = fmaxf(m, zi);                      // fmaxf skips NaN: counted apart
            nan_seen |= isnan(zi);
        }
        nan_seen = __syncthreads_or(nan_seen);
        r.m = block_max(m, s.f);
        if (nan_seen || !(r.m > neg_inf() && r.m < -neg_inf())) {  // no softmax: the greedy token
            token = greedy(z, V, s);
            if (threadIdx.x == 0) out[row] = token;
            return;
        }
        const int k = top_k[row];
        const float p = top_p[row], floor_e = fminf(fmaxf(min_p[row], 0.0f), 1.0f);
        const Cut ck = (k > 0 && k < V) ? top_k_cut(r, k, s) : Cut{0u, V - 1};
        const Cut cp = (p > 0.0f && p < 1.0f) ? top_p_cut(r, ck, p, s) : Cut{0u, V - 1};
        auto kept = [=](int i, float e, u32 b) {
            return keeps(ck, b, i) && keeps(cp, b, i) && b > 0u && e >= floor_e;
        };
        token = inverse_cdf(r, kept, uniforms[row], s);
    }
    if (threadIdx.x == 0) out[row] = token;
}
