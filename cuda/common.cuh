// common.cuh -- device helpers shared by every cuda/*.cu: bf16 <-> f32 on uint16 storage,
// typed loads/stores, warp and block reductions.
// Loader: freetoken/kernels/_cuda.py (NVRTC, -std=c++17, this folder on the include path).
// NVRTC has no host C++ headers (<cstdint> fails), so only builtin types are used here.
// Numerics: bf16 -> f32 is exact (16-bit shift); f32 -> bf16 rounds to nearest even and maps
// NaN to 0x7FC0, bit for bit what freetoken/kernels/_bf16.py from_f32 does.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu
#define WARP 32
#define MAX_WARPS 32  // a block has at most 1024 threads

// NVRTC has no <cmath>, so no INFINITY macro
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float quiet_nan() { return __uint_as_float(0x7fc00000u); }

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (u16)0x7FC0;  // NaN stays a (quiet) NaN
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (u16)(bits >> 16);
}

// Element loads/stores by storage type, so one templated kernel body serves bf16 and f32.
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load(const u16* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(u16* p, long long i, float v) { p[i] = f32_to_bf16(v); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum(int v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide reductions: every thread gets the result. blockDim.x must be a multiple of 32.
// The trailing __syncthreads lets the caller reuse `scratch` (and any smem it wrote before)
// right away. The summation order is fixed, so results are deterministic run to run.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = 0.0f;
    for (int w = 0; w < (int)(blockDim.x / WARP); ++w) r += scratch[w];
    __syncthreads();
    return r;
}

__device__ __forceinline__ int block_sum(int v, int* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int r = 0;
    for (int w = 0; w < (int)(blockDim.x / WARP); ++w) r += scratch[w];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < (int)(blockDim.x / WARP); ++w) r = fmaxf(r, scratch[w]);
    __syncthreads();
    return r;
}

// (value, index) argmax with ties going to the lower index; an index < 0 means "none" and
// loses to everything. Used by the router's top-k and by greedy sampling.
struct ArgMax { float v; int i; };

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        ArgMax b = {__shfl_xor_sync(FULL_MASK, a.v, o), __shfl_xor_sync(FULL_MASK, a.i, o)};
        a = better(a, b);
    }
    return a;
}

__device__ __forceinline__ ArgMax block_argmax(ArgMax a, ArgMax* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    a = warp_argmax(a);
    if (lane == 0) scratch[warp] = a;
    __syncthreads();
    ArgMax r = scratch[0];
    for (int w = 1; w < (int)(blockDim.x / WARP); ++w) r = better(r, scratch[w]);
    __syncthreads();
    return r;
}
