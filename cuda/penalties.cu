// penalties.cu -- repetition, frequency and presence penalties and logit_bias at N sparse
// (row, token) entries of the logits; every other logit is the caller's copy.
// Wrapper: freetoken/kernels/penalties.py   Spec: penalties.ref   Test: tests/kernels/test_gpu_penalties.py
// Launch: grid (ceil(N/256),), block (threads(N) <= 256,); one thread per entry, no shared memory.
// Needs: every array C-contiguous; each (row, token) at most once, so no two threads write the
// same logit and no atomics are needed. An entry outside [0,B) x [0,V) is skipped (the numpy
// versions raise IndexError; a kernel cannot, and must not write outside out).
//
// The copy of logits to out is the wrapper's device copy (out[...] = logits, skipped in place),
// not a kernel: it is a plain D2D copy of B*V floats, which the copy path does at full bandwidth
// and which graph capture records like a launch, while this kernel touches only N logits. Fusing
// the copy in would need a B*V grid and an ordering between copying and adjusting threads.
// out may be logits itself, so neither pointer is __restrict__; each thread reads its logit
// before writing it.
// Numerics: each step is an __f*_rn intrinsic, which nvrtc never contracts into an FMA (its
// default is --fmad=true), so the bits are ref's: z/r or z*r, z - f*c, z - p, z + bias, each
// rounded to float32. CuPy compiles with -ftz=true: a subnormal logit or step result (|z| <
// 2^-126) is flushed to zero where ref keeps it; logits never come near that range.
#include "common.cuh"

__device__ __forceinline__ float penalised(float z, int c, bool seen, float r, float f, float p,
                                           float bias) {
    if (r != 1.0f && seen) z = z > 0.0f ? __fdiv_rn(z, r) : __fmul_rn(z, r);
    z = __fsub_rn(z, __fmul_rn(f, (float)c));
    if (c > 0) z = __fsub_rn(z, p);
    return __fadd_rn(z, bias);
}

extern "C" __global__ void penalties_f32(const float* logits, const int* rows, const int* tokens,
                                         const int* counts, const int* prompt, const float* bias,
                                         const float* presence, const float* frequency,
                                         const float* repetition, float* out, int N, int B, int V) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int b = rows[n], t = tokens[n], c = counts[n];
    if (b < 0 || b >= B || t < 0 || t >= V) return;
    const long long at = (long long)b * V + t;
    const bool seen = c > 0 || prompt[n] != 0;
    out[at] = penalised(logits[at], c, seen, repetition[b], frequency[b], presence[b], bias[n]);
}
