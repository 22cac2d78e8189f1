// cuda_emu.h -- force-included (g++ -include) ahead of a cuda/*.cu file when device_code.py builds
// it for the host: CUDA's keywords, built-in variables, vector types, intrinsics, atomics and warp
// operations, mapped onto the fiber runtime in runtime.cpp / sync.cpp (one fiber per CUDA thread).
// Only what the project's kernels use, plus their close relatives; bf16/half types are not used
// (the kernels keep bf16 as u16 bits) and so are absent: a kernel using one fails to build loudly.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __constant__
// Static shared memory: one copy per module, reused by the blocks (they run one after another);
// shared.ld gathers the function-local ones into the section the runtime poisons at each block
// start. (A __shared__ variable at namespace scope is not gathered: it keeps its contents.)
#define __shared__ static
#define warpSize 32

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

#define EMU_VEC2(T, N, A) struct __align__(A) N##2 { T x, y; }; \
  inline N##2 make_##N##2(T x, T y) { return {x, y}; }
#define EMU_VEC3(T, N) struct N##3 { T x, y, z; }; \
  inline N##3 make_##N##3(T x, T y, T z) { return {x, y, z}; }
#define EMU_VEC4(T, N, A) struct __align__(A) N##4 { T x, y, z, w; }; \
  inline N##4 make_##N##4(T x, T y, T z, T w) { return {x, y, z, w}; }
EMU_VEC2(float, float, 8) EMU_VEC3(float, float) EMU_VEC4(float, float, 16)
EMU_VEC2(int, int, 8) EMU_VEC3(int, int) EMU_VEC4(int, int, 16)
EMU_VEC2(unsigned, uint, 8) EMU_VEC4(unsigned, uint, 16)
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
EMU_VEC2(short, short, 4) EMU_VEC2(unsigned short, ushort, 4) EMU_VEC4(unsigned short, ushort, 8)
EMU_VEC4(signed char, char, 4) EMU_VEC4(unsigned char, uchar, 4)
EMU_VEC2(double, double, 16) EMU_VEC2(long long, longlong, 16)
EMU_VEC2(unsigned long long, ulonglong, 16)

// --- the runtime (runtime.cpp, sync.cpp): the running fiber's state and its services ----------
extern "C" {
extern uint3* emu_thread_idx;  // threadIdx of the running fiber, switched with it
extern uint3 emu_block_idx;
extern dim3 emu_block_dim, emu_grid_dim;
extern void* emu_dyn_smem;     // this launch's dynamic shared buffer (ends at a guard page)
int emu_syncthreads(const char* file, int line, int pred);
unsigned long long emu_warp_op(int op, unsigned mask, unsigned long long v, int arg, int width);
unsigned emu_activemask(void);
void emu_trap(const char* file, int line);
}
#define threadIdx (*static_cast<const uint3*>(emu_thread_idx))
#define blockIdx (static_cast<const uint3&>(emu_block_idx))
#define blockDim (static_cast<const dim3&>(emu_block_dim))
#define gridDim (static_cast<const dim3&>(emu_grid_dim))

// call sites are passed so a divergent barrier is reported with the lines involved
#define __syncthreads() ((void)emu_syncthreads(__FILE__, __LINE__, 0))
#define __syncthreads_count(p) emu_syncthreads(__FILE__, __LINE__, (p) != 0)
#define __syncthreads_or(p) (emu_syncthreads(__FILE__, __LINE__, (p) != 0) != 0)
#define __syncthreads_and(p) (emu_syncthreads(__FILE__, __LINE__, (p) != 0) == \
    (int)(emu_block_dim.x * emu_block_dim.y * emu_block_dim.z))
#define __trap() emu_trap(__FILE__, __LINE__)
// fibers switch only inside runtime calls, so ordering needs no more than a compiler barrier
#define __threadfence() __asm__ __volatile__("" ::: "memory")
#define __threadfence_block() __threadfence()

namespace emu {
enum WarpOp { OP_IDX, OP_UP, OP_DOWN, OP_XOR, OP_BALLOT, OP_ANY, OP_ALL, OP_SYNC };
template <class T> struct same { typedef T type; };  // blocks deduction: atomicAdd(float*, 1)
template <class T> inline T shfl(int op, unsigned mask, T v, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a wide type");
  unsigned long long bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = emu_warp_op(op, mask, bits, arg, width);
  memcpy(&v, &bits, sizeof(T));
  return v;
}
template <class T> inline void atomic_type() {
  static_assert(std::is_same<T, int>::value || std::is_same<T, unsigned>::value ||
                std::is_same<T, long long>::value || std::is_same<T, unsigned long long>::value ||
                std::is_same<T, float>::value || std::is_same<T, double>::value,
                "atomic on a type CUDA has no atomic for");
}
template <class T> inline T bits_as(const void* p) { T r; memcpy(&r, p, sizeof(T)); return r; }
}  // namespace emu

template <class T> inline T __shfl_sync(unsigned m, T v, int src, int w = 32) {
  return emu::shfl(emu::OP_IDX, m, v, src, w);
}
template <class T> inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
  return emu::shfl(emu::OP_UP, m, v, (int)d, w);
}
template <class T> inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
  return emu::shfl(emu::OP_DOWN, m, v, (int)d, w);
}
template <class T> inline T __shfl_xor_sync(unsigned m, T v, int lane_mask, int w = 32) {
  return emu::shfl(emu::OP_XOR, m, v, lane_mask, w);
}
inline unsigned __ballot_sync(unsigned m, int p) { return (unsigned)emu_warp_op(emu::OP_BALLOT, m, p != 0, 0, 32); }
inline int __any_sync(unsigned m, int p) { return emu_warp_op(emu::OP_ANY, m, p != 0, 0, 32) != 0; }
inline int __all_sync(unsigned m, int p) { return emu_warp_op(emu::OP_ALL, m, p != 0, 0, 32) == m; }
inline void __syncwarp(unsigned m = 0xffffffffu) { emu_warp_op(emu::OP_SYNC, m, 0, 0, 32); }
inline unsigned __activemask() { return emu_activemask(); }

// Atomics: fibers never run concurrently and switch only in runtime calls, so a plain
// read-modify-write is already atomic with respect to every other CUDA thread. Not instrumented
// in race mode (emu/race.cpp): atomics never race with each other.
#define EMU_ATOMIC(NAME, EXPR) template <class T> __attribute__((no_sanitize("thread"))) inline T \
    NAME(T* a, typename emu::same<T>::type v) { \
    emu::atomic_type<T>(); T old = *a; *a = (EXPR); return old; }
EMU_ATOMIC(atomicAdd, old + v)
EMU_ATOMIC(atomicSub, old - v)
EMU_ATOMIC(atomicExch, v)
EMU_ATOMIC(atomicMax, old < v ? v : old)
EMU_ATOMIC(atomicMin, v < old ? v : old)
EMU_ATOMIC(atomicAnd, old & v)
EMU_ATOMIC(atomicOr, old | v)
EMU_ATOMIC(atomicXor, old ^ v)
template <class T> __attribute__((no_sanitize("thread"))) inline T atomicCAS(T* a, typename emu::same<T>::type cmp,
                                      typename emu::same<T>::type v) {
  emu::atomic_type<T>();
  T old = *a;
  if (old == cmp) *a = v;
  return old;
}
__attribute__((no_sanitize("thread"))) inline unsigned atomicInc(unsigned* a, unsigned lim) { unsigned o = *a; *a = o >= lim ? 0 : o + 1; return o; }
__attribute__((no_sanitize("thread"))) inline unsigned atomicDec(unsigned* a, unsigned lim) { unsigned o = *a; *a = (o == 0 || o > lim) ? lim : o - 1; return o; }

// min/max of any two arithmetic types, in their common type (CUDA's overload set, flattened)
template <class A, class B> inline typename std::common_type<A, B>::type min(A a, B b) {
  return b < a ? b : a;
}
template <class A, class B> inline typename std::common_type<A, B>::type max(A a, B b) {
  return a < b ? b : a;
}

template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned __float_as_uint(float f) { return emu::bits_as<unsigned>(&f); }
inline int __float_as_int(float f) { return emu::bits_as<int>(&f); }
inline float __uint_as_float(unsigned u) { return emu::bits_as<float>(&u); }
inline float __int_as_float(int i) { return emu::bits_as<float>(&i); }
inline long long __double_as_longlong(double d) { return emu::bits_as<long long>(&d); }
inline double __longlong_as_double(long long i) { return emu::bits_as<double>(&i); }
// built with -ffp-contract=off, so these round each operation on its own like the _rn forms
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return expf(a); }
inline float __exp10f(float a) { return exp10f(a); }
inline float __logf(float a) { return logf(a); }
inline float __log2f(float a) { return log2f(a); }
inline float __sinf(float a) { return sinf(a); }
inline float __cosf(float a) { return cosf(a); }
inline float __tanf(float a) { return tanf(a); }
inline float __powf(float a, float b) { return powf(a, b); }
inline void __sincosf(float a, float* s, float* c) { sincosf(a, s, c); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : a); }
inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
inline int __float2int_rz(float a) { return (int)a; }
inline float __int2float_rn(int a) { return (float)a; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }

// The trampolines device_code.py appends call this: each kernel parameter read from a
// cuLaunchKernel-style array of pointers to the values.
namespace emu {
template <class... A, std::size_t... I>
inline void invoke(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_cv<A>::type*>(p[I])...);
}
template <class... A> inline void invoke(void (*f)(A...), void** p) {
  invoke(f, p, std::index_sequence_for<A...>{});
}
}  // namespace emu
