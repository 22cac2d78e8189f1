"""numba chunked form of gdn_rule (the math of gdn_rule._chunk, one value head at a time) for
long prefill runs; called by gdn_rule.cpu for runs of gdn_rule.CHUNKED_MIN_T tokens or more.
One (sequence, value head) pair per work item, its chunks in order, the state carried in place
between them.

Every big step is a row axpy (y += sum_r x[r] M[r] over contiguous rows, four rows of M per
pass over y): the triangular solve (``rows_axpy``), the written values and the outputs'
inter-chunk term in one read of the state, the state carry two rows at a time (``rows_axpy2``).
Per 64 tokens and head this costs about what 64 recurrent steps do (~190 us on the dev box):
the chunked form does ~1.4x their multiply-adds at ~1.4x their throughput.
"""
import numpy as np

from freetoken.kernels._gdn_cpu import F32, LOG_FLOOR, log_gate, normalise
from freetoken.kernels._numba import HOT, SERIAL, SERIAL_NAN_SAFE, njit, prange

# A chunk's decays reach exp(-1000) and below; products with them go subnormal (~100x slower on
# x86, see _gdn_cpu.LOG_FLOOR): random gates made this form 3-5x slower. Decays below LOG_FLOOR
# are flushed to 0, which keeps even beta * gamma * kn * S (each factor down to ~1e-4) normal.
# Every output and state row also holds an undecayed term (its own token's write, or the
# state), so the dropped part is far under float32's 6e-8 relative precision.


@njit(**SERIAL)
def rows_axpy(M, x, n, y):
    """y += sum_{r < n} x[r] * M[r], y of length <= M's rows."""
    m = y.shape[0]
    r = 0
    while r + 4 <= n:
        x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
        M0, M1, M2, M3 = M[r], M[r + 1], M[r + 2], M[r + 3]
        for j in range(m):
            y[j] += (x0 * M0[j] + x1 * M1[j]) + (x2 * M2[j] + x3 * M3[j])
        r += 4
    while r < n:
        x0, M0 = x[r], M[r]
        for j in range(m):
            y[j] += x0 * M0[j]
        r += 1


@njit(inline="always", **SERIAL)
def dot(x, y):
    acc = F32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    return acc


@njit(**SERIAL)
def load(q, k, a, b, A_log, dt_bias, h, t0, c, qn, kn, g, beta):
    """Normalised queries and keys of the chunk's c tokens from t0, their log decays and betas."""
    kh = h // (a.shape[1] // q.shape[1])
    scale = F32(1.0 / np.sqrt(F32(q.shape[2])))
    for i in range(c):
        normalise(k[t0 + i, kh], F32(1.0), kn[i])
        normalise(q[t0 + i, kh], scale, qn[i])
        g[i], beta[i] = log_gate(a[t0 + i, h], b[t0 + i, h], A_log[h], dt_bias[h])


@njit(**SERIAL_NAN_SAFE)
def flushed_exp(x):
    """exp(x), 0 at or below LOG_FLOOR (see there); NaN stays NaN (_gdn_cpu.gate's comment)."""
    return F32(0.0) if x <= LOG_FLOOR else F32(np.exp(x))


@njit(**SERIAL)
def decays(g, c, seg, dec, gamma):
    """dec[i, j] = exp(g[j+1] + .. + g[i]) for j <= i, each a running segment sum (as
    gdn_rule.segsums: no difference of large cumulative sums); gamma[i] = exp(g[0] + .. + g[i])."""
    total = F32(0.0)
    for i in range(c):
        total += g[i]
        gamma[i] = flushed_exp(total)
        for j in range(i):
            seg[j] += g[i]
        seg[i] = 0.0
        for j in range(i + 1):
            dec[i, j] = flushed_exp(seg[j])


@njit(**SERIAL)
def solve(v, h, t0, c, kn, dec, gamma, beta, coef, X):
    """Rows i of X = [beta v | beta gamma kn] solved through (I + L), L[i, j] = beta_i dec[i, j]
    (kn_i . kn_j) for j < i, by forward substitution (the WY/UT transform). X[i, Dv:] is
    gamma_i times bounded terms, so it is 0 where gamma_i is flushed (else its products of
    unflushed decays go subnormal)."""
    Dv, Dk = v.shape[2], kn.shape[1]
    for i in range(c):
        Xi, bi = X[i], beta[i]
        for j in range(Dv):
            Xi[j] = bi * v[t0 + i, h, j]
        for j in range(Dk):
            Xi[Dv + j] = bi * gamma[i] * kn[i, j]
        for j in range(i):
            coef[j] = -bi * dec[i, j] * dot(kn[i], kn[j])
        rows_axpy(X, coef, i, Xi)
        if gamma[i] == 0.0:
            Xi[Dv:] = 0.0


@njit(**SERIAL)
def rows_axpy2(M, x, z, n, y, w):
    """y += sum_{r < n} x[r] M[r] and w += sum_{r < n} z[r] M[r]: two products, M read once."""
    m = y.shape[0]
    r = 0
    while r + 4 <= n:
        M0, M1, M2, M3 = M[r], M[r + 1], M[r + 2], M[r + 3]
        x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
        z0, z1, z2, z3 = z[r], z[r + 1], z[r + 2], z[r + 3]
        for j in range(m):
            m0, m1, m2, m3 = M0[j], M1[j], M2[j], M3[j]
            y[j] += (x0 * m0 + x1 * m1) + (x2 * m2 + x3 * m3)
            w[j] += (z0 * m0 + z1 * m1) + (z2 * m2 + z3 * m3)
        r += 4
    while r < n:
        M0, x0, z0 = M[r], x[r], z[r]
        for j in range(m):
            y[j] += x0 * M0[j]
            w[j] += z0 * M0[j]
        r += 1


@njit(**SERIAL)
def values_and_outputs(S, X, qn, kn, dec, gamma, c, coef, coef2, W, out, h, t0):
    """Row by row: the written values W[i] = X[i, :Dv] - S^T X[i, Dv:], and out_i =
    gamma_i S^T qn_i + sum_{j <= i} dec[i, j] (qn_i . kn_j) W_j (S the chunk's start state);
    the two products with S share one read of it."""
    Dk, Dv = S.shape
    for i in range(c):
        o = out[t0 + i, h]
        o[:] = 0.0
        W[i, :] = X[i, :Dv]
        for d in range(Dk):
            coef[d] = -X[i, Dv + d]
            coef2[d] = gamma[i] * qn[i, d]
        rows_axpy2(S, coef, coef2, Dk, W[i], o)
        for j in range(i + 1):
            coef[j] = dec[i, j] * dot(qn[i], kn[j])
        rows_axpy(W, coef, i + 1, o)


@njit(**SERIAL)
def carry(S, kn, dec, gamma, W, c, coef, coef2):
    """S = gamma_c S + sum_j dec[c-1, j] kn_j (x) W_j: the state after the chunk, two state rows
    per read of W."""
    Dk, Dv = S.shape
    d = 0
    while d < Dk:
        e = min(d + 1, Dk - 1)                 # an odd last row pairs with itself, coef2 = 0
        for j in range(Dv):
            S[d, j] *= gamma[c - 1]
            if e != d:
                S[e, j] *= gamma[c - 1]
        for j in range(c):
            coef[j] = dec[c - 1, j] * kn[j, d]
            coef2[j] = dec[c - 1, j] * kn[j, e] if e != d else F32(0.0)
        rows_axpy2(W, coef, coef2, c, S[d], S[e])
        d += 2


@njit(**SERIAL)
def run_chunked(q, k, v, a, b, A_log, dt_bias, S, h, t0, t1, chunk, out):
    """Tokens t0..t1-1 of one sequence on value head h in chunks of ``chunk``."""
    Dk, Dv = S.shape
    qn, kn = np.empty((chunk, Dk), F32), np.empty((chunk, Dk), F32)
    X, W = np.empty((chunk, Dv + Dk), F32), np.empty((chunk, Dv), F32)
    dec = np.empty((chunk, chunk), F32)
    g, beta, gamma, seg = (np.empty(chunk, F32), np.empty(chunk, F32), np.empty(chunk, F32),
                           np.empty(chunk, F32))
    coef, coef2 = np.empty(max(Dk, chunk), F32), np.empty(max(Dk, chunk), F32)
    for c0 in range(t0, t1, chunk):
        c = min(chunk, t1 - c0)
        load(q, k, a, b, A_log, dt_bias, h, c0, c, qn, kn, g, beta)
        decays(g, c, seg, dec, gamma)
        solve(v, h, c0, c, kn, dec, gamma, beta, coef, X)
        values_and_outputs(S, X, qn, kn, dec, gamma, c, coef, coef2, W, out, h, c0)
        carry(S, kn, dec, gamma, W, c, coef, coef2)


@njit(**HOT)
def chunked(q, k, v, a, b, A_log, dt_bias, states, slots, starts, seqs, chunk, out):
    """The sequences ``seqs`` in chunks, parallel over (sequence, value head)."""
    Hv = v.shape[1]
    for item in prange(seqs.shape[0] * Hv):
        s, h = seqs[item // Hv], item % Hv
        if starts[s + 1] > starts[s]:
            run_chunked(q, k, v, a, b, A_log, dt_bias, states[slots[s], h], h, starts[s],
                        starts[s + 1], chunk, out)
