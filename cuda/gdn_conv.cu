// gdn_conv.cu -- Gated DeltaNet's causal depthwise conv1d + SiLU over a varlen batch, conv state
// updated in place: out[t,c] = silu(sum_j w[c,j] * u[i+j,c]), u = (state row, sequence's x rows).
// Wrapper: freetoken/kernels/gdn_conv.py   Spec: gdn_conv.ref   Test: tests/kernels/test_gpu_gdn_conv.py
// Launch: grid (ceil(C/256), B, ceil(T/TOKENS)), block (threads(C) <= 256,); thread = channel c of
//   sequence b = blockIdx.y, its tokens [z*TOKENS, (z+1)*TOKENS) (z = blockIdx.z) in order; a
//   chunk past the sequence's end exits. Decode (one token per sequence) is grid (32, B, 1): one
//   read of each state entry and x, one write of each out and new state entry; the weight rows
//   are read once per sequence, from L2 after the first (8192 x 4 bf16 = 64 KiB).
// Needs: every array C-contiguous; K <= MAX_K; seq_starts from 0 to T, non-decreasing; each slot
//   named once (two sequences on one state row would race).
// State in place without a race: only the chunk z = 0 of a sequence reads its state row (a later
//   chunk starts at token >= TOKENS >= K-1, so its window lies in x), and that same thread writes
//   the new state after its reads: entries from x, or, for a sequence of n < K-1 tokens, the old
//   entry n rows later (ascending, so read before overwritten).
// Numerics: fp32; the window sum in ref's order j = 0..K-1 (nvrtc may fuse each step into an FMA:
//   ~1 ulp from ref), silu = a / (1 + expf(-a)) (expf overflow to inf gives -0, as numpy).
#include "common.cuh"

#define MAX_K 8
#define TOKENS 64

__device__ __forceinline__ float silu(float a) { return a / (1.0f + expf(-a)); }

template <typename W>
__device__ __forceinline__ void gdn_conv_impl(const float* x, const W* w, float* states,
                                              const int* slots, const int* starts, float* out,
                                              int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = starts[blockIdx.y], n = starts[blockIdx.y + 1] - s;
    const int i0 = blockIdx.z * TOKENS;
    if (c >= C || i0 >= n) return;
    float* st = states + (long long)slots[blockIdx.y] * (K - 1) * C + c;
    const float* xc = x + (long long)s * C + c;
    float wr[MAX_K], u[MAX_K];  // every index below is static after unrolling: registers
#pragma unroll
    for (int j = 0; j < MAX_K; ++j) {
        const int p = i0 - (K - 1) + j;  // input position of window slot j; < 0: the state's
        wr[j] = j < K ? load(w, (long long)c * K + j) : 0.0f;
        u[j] = j < K - 1 ? (p < 0 ? st[(long long)(K - 1 + p) * C] : xc[(long long)p * C]) : 0.0f;
    }
    const int i1 = min(n, i0 + TOKENS);
    for (int i = i0; i < i1; ++i) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_K; ++j) {
            if (j == K - 1) u[j] = xc[(long long)i * C];
            if (j < K) acc += wr[j] * u[j];
        }
        out[(long long)(s + i) * C + c] = silu(acc);
#pragma unroll
        for (int j = 0; j + 1 < MAX_K; ++j)
            if (j < K - 1) u[j] = u[j + 1];
    }
    if (blockIdx.z != 0) return;
    for (int r = 0; r < K - 1; ++r) {
        const int p = n - (K - 1) + r;
        st[(long long)r * C] = p < 0 ? st[(long long)(r + n) * C] : xc[(long long)p * C];
    }
}

extern "C" __global__ void gdn_conv_bf16(const float* x, const u16* w, float* states,
                                         const int* slots, const int* starts, float* out, int C,
                                         int K) {
    gdn_conv_impl(x, w, states, slots, starts, out, C, K);
}

extern "C" __global__ void gdn_conv_f32(const float* x, const float* w, float* states,
                                        const int* slots, const int* starts, float* out, int C,
                                        int K) {
    gdn_conv_impl(x, w, states, slots, starts, out, C, K);
}
