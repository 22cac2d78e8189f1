// logprobs.cu -- float32 log_softmax per row of logits: the logprob of the row's chosen token and
// the k most probable tokens with theirs (descending, ties -> lower id), for OpenAI's logprobs.
// Wrapper: freetoken/kernels/logprobs.py   Spec: logprobs.ref   Test: tests/kernels/test_gpu_logprobs.py
// Launch: grid (B,), block (threads(V) <= 1024,); one block per row, no dynamic shared memory.
// Needs: logits [B,V], chosen [B], lp_chosen [B], top_ids / top_lp [B,k] C-contiguous;
//   0 <= k <= min(V, MAX_K). Non-finite rows (logprobs.ref's rule): the order reads NaN as -inf;
//   a NaN or +inf logit, or a row of -inf, makes the sum NaN and so every logprob NaN.
//
// Pass 1 reads the row once: each thread keeps the k best (logit, id) of its strided slice in a
// sorted list in local memory, and its max; pass 2 sums expf(z - max). The block's next best
// token is then the best head of the threads' lists, so k rounds of block_argmax over the heads
// (the winner pops its head) merge them: a k-way merge. Chosen over k argmax passes over the row
// because those read the row k times (12 MB instead of 600 KB a row at k = 20, V = 151936, and a
// prefill chunk has up to 512 rows), where a list insertion costs O(k) moves only for the few
// logits above the thread's current k-th (~k ln(V / (k * threads)) + k of them on random rows).
// Ties: a thread visits its ids ascending and inserts after equal values, so each list is in
// (logit descending, id ascending) order, and better() breaks ties between heads by the lower id:
// the merged order is ref's stable one. The order is taken from the logits, as ref's, so ids do
// not depend on the rounding of the logprobs.
// Numerics: lp = (z - max) - logf(sum) in fp32 like ref; the sum is per-thread sequential then a
// block tree (ref: numpy's pairwise sum) with CUDA's expf/logf, so log(sum) agrees with ref to
// ~1e-6 and lp to that plus an ulp of |lp|. Under -ftz an exp below 2^-126 counts as 0, where ref
// keeps it: at most V * 2^-126 next to the max's term, 1. A chosen id outside [0, V) writes NaN
// (the cpu wrapper refuses it on the host; a device-side error would need a sync).
#include "common.cuh"

#define MAX_K 32  // the per-thread lists are fixed local arrays

struct Scratch { float f[MAX_WARPS]; ArgMax am[MAX_WARPS]; };

// a thread's best logits so far, v descending (ties by ascending id); n <= k entries
struct TopList { float v[MAX_K]; int i[MAX_K]; int n; };

// insert (x, id) after every entry >= x; the last entry falls off when the list holds k
__device__ __forceinline__ void list_insert(TopList& l, int k, float x, int id) {
    int p = l.n < k ? l.n++ : k - 1;
    while (p > 0 && l.v[p - 1] < x) {
        l.v[p] = l.v[p - 1];
        l.i[p] = l.i[p - 1];
        --p;
    }
    l.v[p] = x;
    l.i[p] = id;
}

// pass 1: this thread's k best of z[threadIdx.x::blockDim.x] into l; returns the row max
__device__ float scan_row(const float* z, int V, int k, TopList& l, Scratch& s) {
    float m = neg_inf(), kth = neg_inf();
    l.n = 0;
    for (int t = threadIdx.x; t < V; t += blockDim.x) {
        const float x = isnan(z[t]) ? neg_inf() : z[t];   // NaN orders as -inf; the sum sees it
        m = fmaxf(m, x);
        if (k > 0 && (l.n < k || x > kth)) {
            list_insert(l, k, x, t);
            if (l.n == k) kth = l.v[k - 1];
        }
    }
    return block_max(m, s.f);
}

__device__ float log_sum_exp_shifted(const float* z, int V, float m, Scratch& s) {
    float acc = 0.0f;
    for (int t = threadIdx.x; t < V; t += blockDim.x) acc += expf(z[t] - m);
    return logf(block_sum(acc, s.f));
}

// k rounds: the best of the threads' list heads is the next token of the row's order
__device__ void merge_top(const TopList& l, int k, float m, float logsum, int* ids, float* lps,
                          Scratch& s) {
    int h = 0;
    for (int j = 0; j < k; ++j) {
        const ArgMax head = h < l.n ? ArgMax{l.v[h], l.i[h]} : ArgMax{0.0f, -1};
        const ArgMax best = block_argmax(head, s.am);   // every thread holds the same winner
        if (h < l.n && l.i[h] == best.i) ++h;           // ids are unique: one thread pops
        if (threadIdx.x == 0) {
            ids[j] = best.i;
            lps[j] = (best.v - m) - logsum;
        }
    }
}

extern "C" __global__ void logprobs_f32(const float* logits, const int* chosen, float* lp_chosen,
                                        int* top_ids, float* top_lp, int B, int V, int k) {
    __shared__ Scratch s;
    TopList l;
    const int row = blockIdx.x;
    if (row >= B) return;
    const float* z = logits + (long long)row * V;
    const float m = scan_row(z, V, k, l, s);
    const float logsum = log_sum_exp_shifted(z, V, m, s);
    if (threadIdx.x == 0) {
        const int c = chosen[row];
        lp_chosen[row] = (c >= 0 && c < V) ? (z[c] - m) - logsum : quiet_nan();
    }
    merge_top(l, k, m, logsum, top_ids + (long long)row * k, top_lp + (long long)row * k, s);
}
