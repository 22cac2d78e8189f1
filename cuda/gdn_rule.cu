// gdn_rule.cu -- Gated DeltaNet's gated delta rule over a varlen batch: per token, l2-normalise
// q and k, gate (beta = sigmoid(b), alpha = exp(-exp(A_log) * softplus(a + dt_bias))), then
// S = alpha S; u = S^T k; S += k (x) beta (v - u); out = S^T q; the state updated in place.
// Wrapper: freetoken/kernels/gdn_rule.py   Spec: gdn_rule.ref   Test: tests/kernels/test_gpu_gdn_rule.py
// Launch: grid (ceil(Dv/32), Hv, B), block (32 * ceil(Dk/16),): Dk <= gdn_rule.max_key_dim(), as
// many warps as this kernel's registers (ptxas, cuda/launch_limits.json) fit in 64K (Dk <= 272 at
// 120 registers); static shared memory only (~12 KiB). Needs: every array C-contiguous float32 (int32 slots/starts),
// each sequence's slot distinct, Hv a multiple of Hk.
//
// Columns of S are independent: column j evolves from k, q, alpha, beta and v_j alone. So a
// block owns a 32-column tile of one (sequence, value head) state, lane = column (each row of
// the tile is one coalesced 128-byte access), warp w = rows 16w..16w+15, and every thread keeps
// its 16 state values in registers for all of the sequence's tokens: the state is read once and
// written once per call, whatever the token count. Splitting columns across blocks (4 tiles at
// Dv = 128) gives decode at batch 1 Hv * 4 = 128 blocks, about one per SM of an H100/H200.
// Per token: the block publishes q and k (one element per thread) and reduces their squared norms
// (warp sums, one barrier); partial u over each warp's rows meets in shared memory (barrier);
// every thread finishes u_j, updates its rows and forms partial outputs (barrier); warp 0 sums
// and stores out. Three barriers per token, and q, k, gates recomputed by each of a head's 4
// column tiles (2 x Dk loads; the state tile is 16 KiB).
// Prefill (T > 1 per sequence) runs the same loop token by token: exact and with the state
// still read and written once, but serial in T. Each thread fetches token t+1's inputs while
// token t is computed, so a token costs three barriers and its arithmetic plus whatever load
// latency that does not hide: an estimated ~1 us, ~T us per layer (not yet measured on a
// device). The chunked form (gdn_rule.ref_chunked: WY/UT transform, GEMMs that could use
// tensor cores) would make long prompts several times faster. It is not written: this loop is
// correct at every length, and decode, the hot path, is one token per sequence.
// Numerics: fp32 throughout; l2 uses rsqrtf (~2 ulp), gates use expf/log1pf; sums run in a
// different order than ref (per-warp partials, then across warps), so results agree with ref
// to float32 rounding, not bit for bit. CuPy compiles with -ftz=true: a decay below 2^-126
// flushes to 0, where ref keeps a vanishing term.
#include "common.cuh"

#define GDN_RPT 16    // state rows per thread (ROWS_PER_THREAD in the wrapper)
#define GDN_COLS 32   // state columns per block: one per lane
#define GDN_MAX_WARPS 32

struct GdnShared {
    float q[GDN_MAX_WARPS * GDN_RPT];   // the token's raw q and k, zero past Dk
    float k[GDN_MAX_WARPS * GDN_RPT];
    float norms[GDN_MAX_WARPS][2];      // per-warp sums of q^2 and k^2
    float part_u[GDN_MAX_WARPS][GDN_COLS];
    float part_o[GDN_MAX_WARPS][GDN_COLS];
};

__device__ __forceinline__ void gdn_gates(float a, float b, float A_log, float dt_bias,
                                          float* alpha, float* beta) {
    const float x = a + dt_bias;
    const float soft = x > 20.0f ? x : log1pf(expf(x));
    *alpha = expf(-expf(A_log) * soft);
    *beta = 1.0f / (1.0f + expf(-b));
}

// One token's inputs as one thread holds them: element tid of q and k (0 past Dk), its
// column's v, the head's a and b. Fetched a token ahead, so the loads of token t+1 are in
// flight while token t is computed (prefill would otherwise wait on every token's loads).
struct GdnToken { float q, k, v, a, b; };

__device__ __forceinline__ GdnToken gdn_fetch(const float* q, const float* k, const float* v,
                                              const float* a, const float* b, int t, int Hk,
                                              int kh, int Hv, int h, int Dk, int Dv, int j) {
    GdnToken x = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const long long row = ((long long)t * Hk + kh) * Dk;
    if ((int)threadIdx.x < Dk) {
        x.q = q[row + threadIdx.x];
        x.k = k[row + threadIdx.x];
    }
    if (j < Dv) x.v = v[((long long)t * Hv + h) * Dv + j];
    x.a = a[(long long)t * Hv + h];
    x.b = b[(long long)t * Hv + h];
    return x;
}

// Publishes the token's q and k to shared memory and returns (through the pointers) the
// rsqrt of q's (times Dk^-0.5) and of k's squared norm + eps; one barrier.
__device__ __forceinline__ void gdn_publish_qk(const GdnToken& x, int Dk, GdnShared& sh,
                                               float* rq, float* rk) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int nw = blockDim.x / WARP;
    if (tid < Dk) {
        sh.q[tid] = x.q;
        sh.k[tid] = x.k;
    }
    const float sq = warp_sum(x.q * x.q), sk = warp_sum(x.k * x.k);
    if (lane == 0) {
        sh.norms[warp][0] = sq;
        sh.norms[warp][1] = sk;
    }
    __syncthreads();
    float tq = 0.0f, tk = 0.0f;
    for (int w = 0; w < nw; ++w) {
        tq += sh.norms[w][0];
        tk += sh.norms[w][1];
    }
    *rq = rsqrtf(tq + 1e-6f) * rsqrtf((float)Dk);
    *rk = rsqrtf(tk + 1e-6f);
}

// The thread's state values: rows r0..r0+15 of column j (0 outside the state), loaded into
// registers, or stored back when STORE.
template <bool STORE>
__device__ __forceinline__ void gdn_state_io(float* S, float (&s)[GDN_RPT], int r0, int j, int Dk,
                                             int Dv) {
#pragma unroll
    for (int r = 0; r < GDN_RPT; ++r) {
        const bool in = j < Dv && r0 + r < Dk;
        const long long at = (long long)(r0 + r) * Dv + j;
        if (STORE) {
            if (in) S[at] = s[r];
        } else {
            s[r] = in ? S[at] : 0.0f;
        }
    }
}

// Sum over warps of part[w][lane] (after the barrier that published it).
__device__ __forceinline__ float gdn_across_warps(const float (*part)[GDN_COLS], int lane, int nw) {
    float r = 0.0f;
    for (int w = 0; w < nw; ++w) r += part[w][lane];
    return r;
}

extern "C" __global__ void gdn_rule_f32(const float* q, const float* k, const float* v,
                                        const float* a, const float* b, const float* A_log,
                                        const float* dt_bias, float* states, const int* seq_slots,
                                        const int* seq_starts, float* out, int Hk, int Hv, int Dk,
                                        int Dv) {
    __shared__ GdnShared sh;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, nw = blockDim.x / WARP;
    const int j = blockIdx.x * GDN_COLS + lane, h = blockIdx.y, seq = blockIdx.z;
    const int t0 = seq_starts[seq], t1 = seq_starts[seq + 1];
    if (t1 <= t0) return;                       // uniform per block: no barrier is skipped
    const int kh = h / (Hv / Hk), r0 = warp * GDN_RPT;
    for (int i = Dk + tid; i < nw * GDN_RPT; i += blockDim.x) sh.q[i] = sh.k[i] = 0.0f;
    float* S = states + ((long long)seq_slots[seq] * Hv + h) * Dk * Dv;
    const bool col = j < Dv;
    float s[GDN_RPT];
    gdn_state_io<false>(S, s, r0, j, Dk, Dv);
    const float A = A_log[h], dt = dt_bias[h];
    GdnToken x = gdn_fetch(q, k, v, a, b, t0, Hk, kh, Hv, h, Dk, Dv, j);
    for (int t = t0; t < t1; ++t) {
        float rq, rk, alpha, beta;
        gdn_publish_qk(x, Dk, sh, &rq, &rk);
        gdn_gates(x.a, x.b, A, dt, &alpha, &beta);
        const float vj = x.v;
        if (t + 1 < t1) x = gdn_fetch(q, k, v, a, b, t + 1, Hk, kh, Hv, h, Dk, Dv, j);
        float pu = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_RPT; ++r) pu += s[r] * sh.k[r0 + r];
        sh.part_u[warp][lane] = pu;
        __syncthreads();
        const float u = rk * gdn_across_warps(sh.part_u, lane, nw);
        const float dk = beta * (vj - alpha * u) * rk;   // k's normalisation folded into the write
        float po = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_RPT; ++r) {
            s[r] = alpha * s[r] + sh.k[r0 + r] * dk;
            po += s[r] * sh.q[r0 + r];
        }
        sh.part_o[warp][lane] = po;
        __syncthreads();
        if (warp == 0 && col)
            out[((long long)t * Hv + h) * Dv + j] = rq * gdn_across_warps(sh.part_o, lane, nw);
    }
    gdn_state_io<true>(S, s, r0, j, Dk, Dv);
}
