// router.cu -- MoE router: softmax over E in fp32, the k most probable experts ordered by
// probability descending (ties -> lower expert id), renormalised over the k when norm != 0.
// Wrapper: freetoken/kernels/router.py   Spec: router.ref   Test: tests/kernels/test_gpu_router.py
// Launch: grid (T,), block (threads(E) <= 256,), dynamic smem E * 4 bytes; one block per token.
//   k passes of a block argmax over the row's probabilities kept in shared memory (k << E).
// Needs: logits [T,E], ids/weights [T,k] C-contiguous; 1 <= k <= min(E, MAX_K); E <= router.MAX_E
//   (the probabilities and this kernel's 640 B of static shared memory fit in 48 KiB).
// Numerics: expf(x - max) / sum, sum in block tree order (ref sums in numpy order: ~1 ulp).
// Non-finite rows (router.ref's rule): a NaN probability ranks below every number, ties and NaNs
//   to the lower id, so k distinct ids always come back; a NaN or +inf logit, or a row of -inf,
//   makes every probability NaN (the sum is NaN): ids 0..k-1, weights NaN.
#include "common.cuh"

#define MAX_K 32
#define TAKEN -2.0f        // below every probability and below NAN_RANK
#define NAN_RANK -1.0f     // a NaN probability's rank: below every number, above TAKEN

extern "C" __global__ void router_f32(const float* logits, int* ids, float* weights, int T,
                                      int E, int k, int norm) {
    extern __shared__ float smem_p[];              // [E] probabilities (or NaN); taken ones: TAKEN
    __shared__ float scratch[MAX_WARPS];
    __shared__ ArgMax scratch_am[MAX_WARPS];
    __shared__ int smem_ids[MAX_K];
    __shared__ float smem_w[MAX_K];
    const int t = blockIdx.x;
    if (t >= T) return;
    const float* x = logits + (long long)t * E;

    float m = neg_inf();
    for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, x[e]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        smem_p[e] = expf(x[e] - m);
        s += smem_p[e];
    }
    s = block_sum(s, scratch);                     // its barrier also publishes smem_p
    for (int e = threadIdx.x; e < E; e += blockDim.x) smem_p[e] = smem_p[e] / s;
    __syncthreads();

    for (int j = 0; j < k; ++j) {
        ArgMax best = {TAKEN, -1};
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const float p = smem_p[e];
            if (p != TAKEN) best = better(best, ArgMax{isnan(p) ? NAN_RANK : p, e});
        }
        best = block_argmax(best, scratch_am);     // every thread holds the same winner; k <= E
        if (threadIdx.x == 0) {                    // leaves an untaken one, so best.i >= 0
            smem_ids[j] = best.i;
            smem_w[j] = smem_p[best.i];            // the probability itself (NaN stays NaN)
            smem_p[best.i] = TAKEN;
        }
        __syncthreads();
    }

    float total = 0.0f;
    for (int j = 0; j < k; ++j) total += smem_w[j];  // same order in every thread
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        ids[(long long)t * k + j] = smem_ids[j];
        weights[(long long)t * k + j] = norm ? smem_w[j] / total : smem_w[j];
    }
}
