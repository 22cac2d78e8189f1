// experts_quant.cu -- experts.cu's GEMVs and GEMM tiles over quantized banks of one format:
// QFMT, a format code of qblocks.cuh (-DQFMT=9 for q6_k; one module per format a model uses).
// gate_up u8[S,2I,H/V,B], down u8[S,H,I/V,B]; slot s of gate_up starts at byte s * gu_stride (of
// down: s * dn_stride): a slot pool shared by layers of several formats holds the largest expert,
// and a smaller layer reads the first bytes of each slot. The plan and combine kernels are
// experts.cu's (format-free). Launch geometry as experts.cu's *_bf16 entries.
// Wrapper: freetoken/kernels/experts.py (gpu)   Spec: experts.ref   Test: tests/kernels/test_gpu_quant.py
#include "experts_impl.cuh"

#ifndef QFMT
#define QFMT Q8_0
#endif

extern "C" __global__ void experts_gate_up_q(const float* x, const int* ids, const u8* gate_up,
                                             long long gu_stride, float* act, int k, int H, int I,
                                             int S, const float* gu_bias, float alpha, float limit,
                                             int use_bias, int clamped) {
  gate_up_impl(x, ids, QPtr<QFMT>{gate_up}, (size_t)gu_stride, act, k, H, I, S,
               Glu{gu_bias, alpha, limit, use_bias, clamped});
}

extern "C" __global__ void experts_down_q(const int* ids, const float* weights, const u8* down,
                                          long long dn_stride, const float* act, float* out, int k,
                                          int H, int I, int S, const float* dn_bias, int use_bias) {
  down_impl(ids, weights, QPtr<QFMT>{down}, (size_t)dn_stride, act, out, k, H, I, S,
            Glu{dn_bias, 0.f, 0.f, use_bias, 0});
}

extern "C" __global__ void experts_gemm_gate_up_q(
    const float* x, const u8* gate_up, long long gu_stride, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* act, int k, int H,
    int I, const float* gu_bias, float alpha, float limit, int use_bias, int clamped) {
  gemm_tiles<true>(x, QPtr<QFMT>{gate_up}, (size_t)gu_stride, (size_t)I * q_row_bytes<QFMT>(H),
                   perm, offs, tile_expert, tile_row, n_tiles, act, k, H, I,
                   Glu{gu_bias, alpha, limit, use_bias, clamped});
}

extern "C" __global__ void experts_gemm_down_q(
    const float* act, const u8* down, long long dn_stride, const int* perm, const int* offs,
    const int* tile_expert, const int* tile_row, const int* n_tiles, float* y, int H, int I,
    const float* dn_bias, int use_bias) {
  gemm_tiles<false>(act, QPtr<QFMT>{down}, (size_t)dn_stride, 0, perm, offs, tile_expert,
                    tile_row, n_tiles, y, 1, I, H,
                    Glu{dn_bias, 0.f, 0.f, use_bias, 0});
}
