// qblocks.cuh -- quantized weight rows on the device: 8 values of a row of blocks at a time, the
// values exactly as the spec (freetoken/kernels/qformats.py dequantize_ref: gguf-py's dequantize,
// and kernels/qfp8.py for the FP8 row blocks). The products and sums are the _rn intrinsics, in
// the spec's order, so no FMA contraction changes a bit (a value d*sc*q - dmin*m is one rounding
// per operation, as numpy's float32 arithmetic).
// Used by gemv_common.cuh (the GEMV rows and GEMM tiles of linear.cu and experts.cu) and qblocks.cu.
// Shapes: a row of K values is NB = K/V blocks of B bytes (V, B per format: QV, QB below); a
// weight is rows of blocks, row m at byte m * NB * B. Block layouts, byte offsets:
//   q4_0 d 0, qs 2 | q4_1 d 0, m 2, qs 4 | q5_0 d 0, qh 2 (u32), qs 6 | q5_1 d 0, m 2, qh 4, qs 8
//   q8_0 d 0, qs 2 (i8) | q2_k sc 0, qs 16, d 80, dmin 82 | q3_k qh 0, qs 32, sc 96, d 108
//   q4_k d 0, dmin 2, sc 4, qs 16 | q5_k d 0, dmin 2, sc 4, qh 16, qs 48
//   q6_k ql 0, qh 128, sc 192 (i8), d 208 | fp8_b128 scale 0 (f32), codes 4 (e4m3fn)
//   mxfp4 e 0 (e8m0), qs 1 (e2m1: value j low nibble of qs[j], j + 16 its high nibble)
#pragma once
#include "common.cuh"

typedef unsigned char u8;

// Format codes, as kernels/qformats.py numbers them (FORMATS' index).
#define Q4_0 0
#define Q4_1 1
#define Q5_0 2
#define Q5_1 3
#define Q8_0 4
#define Q2_K 5
#define Q3_K 6
#define Q4_K 7
#define Q5_K 8
#define Q6_K 9
#define FP8_B128 10
#define MXFP4 11

// X(name, code) for every format: the kernel entries are generated from this list.
#define FOR_EACH_QFORMAT(X) \
  X(q4_0, Q4_0) X(q4_1, Q4_1) X(q5_0, Q5_0) X(q5_1, Q5_1) X(q8_0, Q8_0) X(q2_k, Q2_K) \
  X(q3_k, Q3_K) X(q4_k, Q4_K) X(q5_k, Q5_K) X(q6_k, Q6_K) X(fp8_b128, FP8_B128) X(mxfp4, MXFP4)

template <int C> struct QV {
  static constexpr int v = (C <= Q8_0 || C == MXFP4) ? 32 : (C == FP8_B128 ? 128 : 256);
};
template <int C> struct QB {
  static constexpr int v = C == Q4_0 ? 18 : C == Q4_1 ? 20 : C == Q5_0 ? 22 : C == Q5_1 ? 24 :
                           C == Q8_0 ? 34 : C == Q2_K ? 84 : C == Q3_K ? 110 : C == Q4_K ? 144 :
                           C == Q5_K ? 176 : C == Q6_K ? 210 : C == MXFP4 ? 17 : 132;
};

// A quantized matrix or row of format C: its first byte. Rows are whole blocks, so K % V == 0.
template <int C> struct QPtr { const u8* p; };

template <int C> __device__ __forceinline__ size_t q_row_bytes(int K) {
  return (size_t)(K / QV<C>::v) * QB<C>::v;
}

// ---- block fields ----------------------------------------------------------------------------
// fp16 at p (any alignment) as f32, exact: built from its bits, as numpy's astype widens it.
__device__ __forceinline__ float f16_at(const u8* p) {
  const u32 h = (u32)p[0] | ((u32)p[1] << 8);
  const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact
    const float v = __fmul_rn((float)m, 5.9604644775390625e-8f);
    return sign ? -v : v;
  }
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ u32 u32_at(const u8* p) {
  return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// e4m3fn code -> f32 (exact): exponent 0 subnormal (m * 2^-9), 0x7F / 0xFF NaN, no infinity.
__device__ __forceinline__ float e4m3_value(u32 c) {
  const u32 sign = (c & 0x80u) << 24, e = (c >> 3) & 15u, m = c & 7u;
  if ((c & 0x7fu) == 0x7fu) return __uint_as_float(sign | 0x7fc00000u);
  if (e == 0) {
    const float v = __fmul_rn((float)m, 0.001953125f);
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// (scale, min) of 32-value sub-block j of a q4_k / q5_k block: 6-bit pairs packed in 12 bytes at 4.
__device__ __forceinline__ void scale_min_k(const u8* blk, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = blk[4 + j] & 63;
    mn = blk[8 + j] & 63;
  } else {
    sc = (blk[8 + j] & 15) | ((blk[j] >> 6) << 4);
    mn = (blk[8 + j] >> 4) | ((blk[4 + j] >> 6) << 4);
  }
}

// k * 2^(e - 128) for the e8m0 exponents 0 and 1, whose scale is subnormal: built from bits, since
// -ftz=true (CuPy's) flushes a subnormal factor or product to zero. m is the value in units of
// 2^-149, below 2^26 (k <= 12); from 2^24 on it is normal with s = log2(m) - 23 bits dropped
// (zeros: m = k << 21 at least) and exponent field s + 1.
__device__ __forceinline__ float mxfp4_tiny(u32 e, int k, int negative) {
  const u32 m = (u32)k << (e + 21);
  const int s = max(0, 8 - __clz((int)m));
  return __uint_as_float(((u32)s << 23) + (m >> s) + (negative && k ? 0x80000000u : 0u));
}

// ---- 8 values of a block ---------------------------------------------------------------------
// v[i] = value j + i of the block at blk; j % 8 == 0, so the 8 share every sub-block scale.
template <int C>
__device__ __forceinline__ void block8(const u8* blk, int j, float (&v)[8]) {
  if (C == Q8_0) {
    const float d = f16_at(blk);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d, (float)(signed char)blk[2 + j + i]);
  } else if (C <= Q5_1) {  // 32 values: nibble (j >> 4) of qs[l], bit l + 16*(j >> 4) of qh as bit 4
    const int qs = C == Q4_0 ? 2 : C == Q4_1 ? 4 : C == Q5_0 ? 6 : 8, half = j >> 4, l0 = j & 15;
    const float d = f16_at(blk), m = (C == Q4_1 || C == Q5_1) ? f16_at(blk + 2) : 0.f;
    const u32 qh = C == Q5_0 ? u32_at(blk + 2) : C == Q5_1 ? u32_at(blk + 4) : 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int q = (blk[qs + l0 + i] >> (4 * half)) & 15;
      if (C == Q5_0 || C == Q5_1) q |= ((qh >> (l0 + i + 16 * half)) & 1u) << 4;
      if (C == Q4_1 || C == Q5_1) v[i] = __fadd_rn(__fmul_rn(d, (float)q), m);
      else v[i] = __fmul_rn(d, (float)(q - (C == Q4_0 ? 8 : 16)));
    }
  } else if (C == Q4_K || C == Q5_K) {  // eight 32-value sub-blocks: (d*sc)*q - dmin*m
    const int sb = j >> 5, l0 = j & 31, qs = C == Q4_K ? 16 : 48;
    int sc, mn;
    scale_min_k(blk, sb, sc, mn);
    const float dl = __fmul_rn(f16_at(blk), (float)sc), ml = __fmul_rn(f16_at(blk + 2), (float)mn);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int q = (blk[qs + (sb >> 1) * 32 + l0 + i] >> (4 * (sb & 1))) & 15;
      if (C == Q5_K) q |= ((blk[16 + l0 + i] >> sb) & 1) << 4;
      v[i] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
    }
  } else if (C == MXFP4) {  // doubled e2m1 codes times 2^(e - 128), built from its bits: exact
    const u32 e = blk[0];
    const float d = __uint_as_float((e - 1u) << 23);  // 2^(e - 128) for e >= 2
    const int half = j >> 4, l0 = j & 15;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = (blk[1 + l0 + i] >> (4 * half)) & 15, m = q & 7;
      const int k = m < 4 ? m : (m == 4 ? 4 : m == 5 ? 6 : m == 6 ? 8 : 12);
      v[i] = e < 2 ? mxfp4_tiny(e, k, q & 8) : __fmul_rn(d, (float)(q & 8 ? -k : k));
    }
  } else if (C == FP8_B128) {
    const float s = __uint_as_float(u32_at(blk));
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(e4m3_value(blk[4 + j + i]), s);
  } else {  // q2_k, q3_k, q6_k: sixteen 16-value sub-blocks (n = j >> 4) in 32-value groups g
    const int n = j >> 4, g = j >> 5, l0 = j & 31;
    float dl, ml = 0.f;
    if (C == Q2_K) {
      dl = __fmul_rn(f16_at(blk + 80), (float)(blk[n] & 15));
      ml = __fmul_rn(f16_at(blk + 82), (float)(blk[n] >> 4));
    } else if (C == Q3_K) {
      const int lo = (blk[96 + (n & 7)] >> (4 * (n >> 3))) & 15;
      const int hi = (blk[104 + (n & 3)] >> (2 * (n >> 2))) & 3;
      dl = __fmul_rn(f16_at(blk + 108), (float)((lo | (hi << 4)) - 32));
    } else {
      dl = __fmul_rn(f16_at(blk + 208), (float)(signed char)blk[192 + n]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int l = l0 + i;
      int q;
      if (C == Q6_K) {
        const int s = g & 3, h = g >> 2;
        q = ((blk[h * 64 + (s & 1) * 32 + l] >> (4 * (s >> 1))) & 15)
            | (((blk[128 + h * 32 + l] >> (2 * s)) & 3) << 4);
        q -= 32;
      } else {
        q = (blk[(C == Q2_K ? 16 : 32) + (g >> 2) * 32 + l] >> (2 * (g & 3))) & 3;
        if (C == Q3_K) q = (q | (((blk[l] >> g) & 1) << 2)) - 4;
      }
      v[i] = C == Q2_K ? __fsub_rn(__fmul_rn(dl, (float)q), ml) : __fmul_rn(dl, (float)q);
    }
  }
}

// v = values k .. k+7 of the quantized row at `row` (k % 8 == 0).
template <int C>
__device__ __forceinline__ void qload8(const u8* row, int k, float (&v)[8]) {
  block8<C>(row + (size_t)(k / QV<C>::v) * QB<C>::v, k % QV<C>::v, v);
}
