// sigmoid_mul.cu -- y = x * sigmoid(gate), gate [R,D] (gated attention's output gate) or [R,1]
// (the shared expert's gate, one scalar per row broadcast over it).
// Wrapper: freetoken/kernels/sigmoid_mul.py   Spec: sigmoid_mul.ref   Test: tests/kernels/test_gpu_sigmoid_mul.py
// Launch: grid (ceil(R*D/256),), block (threads(R*D) <= 256,); one thread per element.
// Needs: every array C-contiguous; G (gate columns) is D or 1; y may be x (each element is read
//   and written by the same thread).
// Numerics: fp32, sigmoid = 1 / (1 + expf(-g)) as ref (expf overflow to inf gives 0).
#include "common.cuh"

extern "C" __global__ void sigmoid_mul_f32(const float* x, const float* gate, float* y, int R,
                                           int D, int G) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)R * D) return;
    const long long r = e / D;
    const float g = gate[G == 1 ? r : e];
    y[e] = x[e] * (1.0f / (1.0f + expf(-g)));
}
