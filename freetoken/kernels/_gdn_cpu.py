"""numba recurrent form of gdn_rule.cpu (freetoken/kernels/gdn_rule.py), for decode and (see
gdn_rule.CHUNKED_MIN_T) prefill; the gate and l2 helpers are shared with _gdn_chunked.py. One
(sequence, value head) pair per parallel work item: value heads never interact, so each item
owns its 64 KiB state (Dk = Dv = 128) and keeps it in its core's L2 for the whole run.

State rows S[i, :] are contiguous (Dv floats), so every inner loop here runs along a row and
vectorises; each helper is its own compiled function because numba vectorises a plain loop but
not one written inside a prange body (see _membw.py).
"""
import numpy as np

from freetoken.kernels._numba import HOT, SERIAL, SERIAL_NAN_SAFE, njit, prange

F32 = np.float32
# exp(g) below exp(-40) ~ 4e-18 is flushed to 0: alpha * S would otherwise go subnormal, which
# x86 handles in microcode (~100x slower; numba sets no flush-to-zero). The decayed state it
# drops is far under float32's relative precision against the token's own write.
LOG_FLOOR = F32(-40.0)
# The gate helpers (per token, not per state element) keep NaN as ref does (gdn_rule's
# "Non-finite inputs"): their flush tests g <= LOG_FLOOR, false for NaN, so a NaN gate gives a
# NaN decay, not 0 (a decay of 0 wiped the state and hid the NaN); and they compile
# SERIAL_NAN_SAFE, under which LLVM may not assume that no NaN reaches a comparison.


@njit(**SERIAL_NAN_SAFE)
def log_gate(a, b, A_log, dt_bias):
    """(g, beta) of one token and value head, as gdn_rule.gates."""
    x = a + dt_bias
    soft = x if x > F32(20.0) else F32(np.log1p(np.exp(x)))
    return F32(-np.exp(A_log) * soft), F32(1.0) / (F32(1.0) + F32(np.exp(-b)))


@njit(**SERIAL_NAN_SAFE)
def gate(a, b, A_log, dt_bias):
    """(alpha = exp(g), flushed to 0 at or below LOG_FLOOR, NaN for a NaN g; beta)."""
    g, beta = log_gate(a, b, A_log, dt_bias)
    return (F32(0.0) if g <= LOG_FLOOR else F32(np.exp(g))), beta


@njit(**SERIAL)
def normalise(x, scale, res):
    """res = x * rsqrt(sum x^2 + 1e-6) * scale (gdn_rule.l2)."""
    ss = F32(0.0)
    for i in range(x.shape[0]):
        ss += x[i] * x[i]
    r = scale / np.sqrt(ss + F32(1e-6))
    for i in range(x.shape[0]):
        res[i] = x[i] * r


@njit(**SERIAL)
def predict(S, kn, u):
    """u = S^T kn: one read pass over the state."""
    u[:] = 0.0
    for i in range(S.shape[0]):
        Si, ki = S[i], kn[i]
        for j in range(Si.shape[0]):
            u[j] += Si[j] * ki


@njit(**SERIAL)
def update(S, alpha, kt, d, qt, o):
    """S = alpha S + kt (x) d and o = S^T qt, in one pass."""
    o[:] = 0.0
    for i in range(S.shape[0]):
        Si, ki, qi = S[i], kt[i], qt[i]
        for j in range(Si.shape[0]):
            s = alpha * Si[j] + ki * d[j]
            Si[j] = s
            o[j] += s * qi


@njit(**SERIAL)
def update_predict(S, alpha, kt, d, qt, o, kn, u):
    """``update`` plus u = S^T kn for the next token's key, in the same pass: a prefill token
    reads and writes the state once."""
    o[:] = 0.0
    u[:] = 0.0
    for i in range(S.shape[0]):
        Si, ki, qi, ni = S[i], kt[i], qt[i], kn[i]
        for j in range(Si.shape[0]):
            s = alpha * Si[j] + ki * d[j]
            Si[j] = s
            o[j] += s * qi
            u[j] += s * ni


@njit(**SERIAL)
def written(v, alpha, beta, u, d):
    """d = beta (v - alpha u): the delta rule's write, u = S^T kn before the decay."""
    for j in range(d.shape[0]):
        d[j] = beta * (v[j] - alpha * u[j])


@njit(**SERIAL)
def run_recurrent(q, k, v, a, b, A_log, dt_bias, S, h, t0, t1, out):
    """Tokens t0..t1-1 of one sequence on value head h, state S f32[Dk,Dv] in place."""
    Dk, Dv = S.shape
    kh = h // (v.shape[1] // q.shape[1])
    scale = F32(1.0 / np.sqrt(F32(Dk)))
    kt, kn, qt = np.empty(Dk, F32), np.empty(Dk, F32), np.empty(Dk, F32)
    u, d = np.empty(Dv, F32), np.empty(Dv, F32)
    normalise(k[t0, kh], F32(1.0), kn)
    predict(S, kn, u)
    for t in range(t0, t1):
        kt, kn = kn, kt
        normalise(q[t, kh], scale, qt)
        alpha, beta = gate(a[t, h], b[t, h], A_log[h], dt_bias[h])
        written(v[t, h], alpha, beta, u, d)
        if t + 1 < t1:
            normalise(k[t + 1, kh], F32(1.0), kn)
            update_predict(S, alpha, kt, d, qt, out[t, h], kn, u)
        else:
            update(S, alpha, kt, d, qt, out[t, h])


@njit(**HOT)
def recurrent(q, k, v, a, b, A_log, dt_bias, states, slots, starts, seqs, out):
    """The sequences ``seqs`` token by token, parallel over (sequence, value head). A decode
    token streams its state twice: a read pass for u = S^T k, then the update pass (the second
    read hits the core's cache); prefill tokens fuse each update with the next token's u."""
    Hv = v.shape[1]
    for item in prange(seqs.shape[0] * Hv):
        s, h = seqs[item // Hv], item % Hv
        if starts[s + 1] > starts[s]:
            run_recurrent(q, k, v, a, b, A_log, dt_bias, states[slots[s], h], h, starts[s],
                          starts[s + 1], out)
