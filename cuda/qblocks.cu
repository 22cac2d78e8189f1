// qblocks.cu -- rows of a quantized weight dequantized to f32 on the device, bit for bit the spec
// (kernels/qformats.py dequantize_ref): the embedding gather of a quantized table, and the
// device-side check of qblocks.cuh's loads. One format per module: QFMT, a code of qblocks.cuh.
// Wrapper: freetoken/kernels/embedding.py (gpu)   Spec: embedding.ref   Test: tests/kernels/test_gpu_quant.py
// q_rows_f32: out[r, :] = the values of row ids[r] of w u8[V,K/V',B] (ids i32[R]); an id outside
//   [0, V) gives a NaN row, as embedding.cu does (a kernel cannot raise).
//   grid (R, ceil(K/1024)), block 128: thread i of block (r, y) writes values 8*(128y + i) .. +8
//   of row r (rows in grid x: a prefill chunk may exceed grid y's 65535).
#include "qblocks.cuh"

#ifndef QFMT
#define QFMT Q8_0
#endif

extern "C" __global__ void q_rows_f32(const u8* w, const int* ids, float* out, int R, int K,
                                      int V) {
  const int r = blockIdx.x, k = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (r >= R || k >= K) return;
  const int id = ids[r];
  float v[8] = {quiet_nan(), quiet_nan(), quiet_nan(), quiet_nan(),
                quiet_nan(), quiet_nan(), quiet_nan(), quiet_nan()};
  if (id >= 0 && id < V) qload8<QFMT>(w + (size_t)id * q_row_bytes<QFMT>(K), k, v);
  float* o = out + (size_t)r * K + k;
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = v[i];
}
