// rope.cu -- NeoX rotate-half rotary embedding: element i of a head pairs with i + R/2,
// angle = float(pos) * inv_freq[i] (fp32 product); elements past R (partial rotary) are copied.
// Wrapper: freetoken/kernels/rope.py   Spec: rope.ref   Test: tests/kernels/test_gpu_rope.py
// Launch: grid (T,), block (threads(half) <= 256,); one block per token, each thread owns
//   frequencies i, i + blockDim.x, ... and rotates them in every head (one sincos per pair).
// Needs: x, out [T,nh,D] C-contiguous, 2*half <= D; out may be x (a thread reads both halves
//   of a pair before writing them, and tail elements are owned by one thread).
// Numerics: fp32; sincosf with full range reduction (no fast math), like numpy's float32 cos/sin.
#include "common.cuh"

extern "C" __global__ void rope_f32(const float* x, const int* positions, const float* inv_freq,
                                    float* out, int T, int nh, int D, int half) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const float pos = (float)positions[t];
    const long long base = (long long)t * nh * D;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        for (int h = 0; h < nh; ++h) {
            const long long o = base + (long long)h * D + i;
            const float x1 = x[o], x2 = x[o + half];
            out[o] = x1 * c - x2 * s;
            out[o + half] = x2 * c + x1 * s;
        }
    }
    const int tail = D - 2 * half;
    for (int j = threadIdx.x; j < nh * tail; j += blockDim.x) {
        const long long o = base + (long long)(j / tail) * D + 2 * half + j % tail;
        out[o] = x[o];
    }
}
