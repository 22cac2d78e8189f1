"""Gated DeltaNet's gated delta rule over a varlen batch, the linear-attention half of the
Qwen3-Next / Qwen3.5 hybrid layers; pairs: cuda/gdn_rule.cu, tests/kernels/test_gdn_rule.py.

Sequence b owns tokens seq_starts[b]:seq_starts[b+1] (in order) and the state row
S = states[seq_slots[b]] f32[Hv,Dk,Dv], read and written in place. Per token, value head h
(key head h // (Hv/Hk)):
    qn = l2(q) * Dk^-0.5, kn = l2(k), l2(x) = x * rsqrt(sum x^2 + 1e-6)
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)    (softplus(x) = x above 20)
    S = exp(g) * S;  u = S^T kn;  S += kn (x) beta * (v - u);  out = S^T qn
``ref`` is that recurrence, token by token. ``ref_chunked`` is the same map in the chunked form
prefill uses (see its docstring), written once in numpy as the spec the chunked kernels follow.
``cpu`` runs numba kernels of both forms (_gdn_cpu.py, _gdn_chunked.py), ``gpu`` the token loop
of cuda/gdn_rule.cu.

Non-finite inputs (every implementation follows ``ref``, ``ref_chunked`` too): sequences, value
heads and state columns never mix, so a bad input at token t of sequence b reaches only b's
outputs from t on and its state row states[seq_slots[b]]; other sequences' outputs and rows, and
b's tokens before t, come out as without it. A spoilt state stays spoilt: a NaN decayed by any
alpha, 0 included, is NaN.
  - NaN or inf in q[t, kh]: qn holds a NaN (l2: inf * rsqrt(inf) = inf * 0), so out[t, h] is NaN
    for the value heads h of key head kh, at t only (q never enters the state).
  - NaN or inf in k[t, kh]: kn holds a NaN, so u and the write kn (x) beta (v - u) are NaN in every
    entry: the state of the heads h of kh and out[t:, h] are NaN.
  - NaN in v[t, h, j]: column j of head h's state and out[t:, h, j] are NaN (each column of S
    evolves on its own). An inf makes the same entries non-finite: the column's infinities meet
    with both signs and turn NaN; out[t, h, j] itself is NaN or inf by summation order.
  - NaN in a[t, h] or b[t, h]: a NaN decay or beta, so head h's state and out[t:, h] are NaN. The
    cpu kernels' LOG_FLOOR flush (decays under e^-40 taken as 0) leaves a NaN decay NaN: a decay
    of 0 would wipe the state and hide the NaN.
  - Infinite gate inputs are their limits, all finite: a = +inf decays by 0 (the state restarts),
    a = -inf not at all (softplus 0); b = +inf is beta 1, b = -inf beta 0 (no write).
  - A finite q or k row whose squares overflow (an element past ~1.8e19) normalises to 0
    (rsqrt(inf) = 0): a zero query (out 0 at t) or key (no write). The gpu applies l2's factor
    after its sums, so it agrees while those (S times the raw row) stay finite.
"""
import numpy as np

EPS = np.float32(1e-6)          # inside l2's rsqrt, as in FLA and transformers' l2norm
SOFTPLUS_LINEAR = np.float32(20.0)  # torch's softplus threshold: above it softplus(x) = x
CHUNK = 64                      # tokens per chunk of the chunked form (FLA's chunk_size)


def gates(a, b, A_log, dt_bias):
    """a, b f32[T,Hv], A_log, dt_bias f32[Hv] -> (g, beta) f32[T,Hv], g the log decay (<= 0)."""
    x = (a + dt_bias).astype(np.float32)
    with np.errstate(over="ignore"):   # exp overflows only where the threshold discards it
        soft = np.where(x > SOFTPLUS_LINEAR, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_LINEAR))))
        beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-b.astype(np.float32)))
    g = -np.exp(A_log.astype(np.float32)) * soft.astype(np.float32)
    return g.astype(np.float32), beta.astype(np.float32)


def l2(x):
    """x f32[..., D] -> x * rsqrt(sum x^2 + 1e-6) over the last axis."""
    x = x.astype(np.float32)
    return x * (np.float32(1.0) / np.sqrt((x * x).sum(-1, keepdims=True) + EPS))


def normed(q, k, Hv):
    """(qn, kn) f32[T,Hv,Dk]: l2-normalised, q scaled by Dk^-0.5, key heads repeated per value
    head (value head h reads key head h // (Hv/Hk), torch's repeat_interleave)."""
    rep = Hv // q.shape[1]
    scale = np.float32(q.shape[2] ** -0.5)
    return np.repeat(l2(q) * scale, rep, axis=1), np.repeat(l2(k), rep, axis=1)


def _check(q, k, v, a, b, states, seq_slots, seq_starts):
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    assert k.shape == q.shape and v.shape[0] == T and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert a.shape == b.shape == (T, Hv), (a.shape, b.shape, T, Hv)
    assert states.shape[1:] == (Hv, Dk, Dv), (states.shape, Hv, Dk, Dv)
    assert seq_starts.shape == (seq_slots.shape[0] + 1,), (seq_slots.shape, seq_starts.shape)


def ref(q, k, v, a, b, A_log, dt_bias, states, seq_slots, seq_starts, out=None):
    """q, k f32[T,Hk,Dk], v f32[T,Hv,Dv], a, b f32[T,Hv], A_log, dt_bias f32[Hv],
    states f32[N,Hv,Dk,Dv] (rows seq_slots[b] updated in place), seq_slots int32[B],
    seq_starts int32[B+1] -> f32[T,Hv,Dv]; token by token, all value heads at once."""
    _check(q, k, v, a, b, states, seq_slots, seq_starts)
    qn, kn = normed(q, k, v.shape[1])
    g, beta = gates(a, b, A_log, dt_bias)
    res = np.zeros(v.shape, np.float32)
    for s in range(seq_slots.shape[0]):
        S = states[seq_slots[s]]                                          # [Hv,Dk,Dv] view
        for t in range(seq_starts[s], seq_starts[s + 1]):
            S *= np.exp(g[t])[:, None, None]
            u = (kn[t][:, None, :] @ S)[:, 0]                             # [Hv,Dv]
            S += kn[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
            res[t] = (qn[t][:, None, :] @ S)[:, 0]
    if out is None:
        return res
    out[...] = res
    return out


def segsums(g):
    """g f32[..., c] -> f32[..., c, c]: [i, j] = g[j+1] + ... + g[i] for j < i, 0 on and above
    the diagonal. Summed segment by segment, not as a difference of two cumulative sums, so a
    strongly decaying chunk (cumulative log decay in the thousands) keeps full precision."""
    c = g.shape[-1]
    below = np.tril(np.ones((c, c), bool), -1)
    parts = np.where(below, g[..., :, None], np.float32(0.0))              # [.., i, j] = g_i, j < i
    return np.cumsum(parts, axis=-2, dtype=np.float32)


def _solve_unit_lower(L, rhs):
    """(I + L) x = rhs for strictly lower-triangular L f32[H,c,c], rhs f32[H,c,n]: forward
    substitution, one row at a time (the triangular solve of the chunked form)."""
    x = rhs.copy()
    for i in range(1, x.shape[1]):
        x[:, i] -= (L[:, i:i + 1, :i] @ x[:, :i])[:, 0]
    return x


def _causal(A, w):
    """sum_{j <= i} A[:, i, j] w[:, j] for each row i of A f32[H,c,c], w f32[H,c,n], token j
    added to rows i >= j only. One product over whole rows would add 0 * w_j for j > i, NaN where
    a later token's w is, and spoil the chunk's earlier outputs (ref keeps them)."""
    res = np.zeros(A.shape[:2] + w.shape[2:], np.float32)
    for j in range(A.shape[1]):
        res[:, j:] += A[:, j:, j, None] * w[:, j, None, :]
    return res


def _chunk(S, qn, kn, v, g, beta):
    """One chunk of c tokens of one sequence, all value heads: S f32[Hv,Dk,Dv] updated in place,
    qn, kn f32[Hv,c,Dk], v f32[Hv,c,Dv], g, beta f32[Hv,c] -> out f32[Hv,c,Dv].

    With gamma_i = exp(g_1 + .. + g_i) and d_ij = exp(g_{j+1} + .. + g_i) (i >= j), the
    recurrence unrolls to S_i = gamma_i S_0 + sum_{j<=i} d_ij kn_j w_j^T, where the written
    values w solve (I + L) w = beta v - beta gamma kn S_0, L_ij = beta_i d_ij (kn_i . kn_j) for
    j < i (the WY/UT transform). Then out_i = gamma_i S_0^T qn_i + sum_{j<=i} d_ij (qn_i . kn_j) w_j
    and S_c = gamma_c S_0 + sum_j d_cj kn_j w_j^T."""
    Dv = v.shape[2]
    seg = segsums(g)                                                      # [Hv,c,c]
    lower = np.tril(np.ones(seg.shape[1:], bool))
    decay = np.where(lower, np.exp(seg), np.float32(0.0))                 # d_ij, j <= i
    gamma = np.exp(np.cumsum(g, axis=1, dtype=np.float32))                # [Hv,c]
    kk = kn @ kn.transpose(0, 2, 1)
    L = np.tril(beta[:, :, None] * decay * kk, -1)
    rhs = np.concatenate([beta[..., None] * v, (beta * gamma)[..., None] * kn], axis=2)
    x = _solve_unit_lower(L, rhs)
    w = x[..., :Dv] - x[..., Dv:] @ S                                     # [Hv,c,Dv]
    out = gamma[..., None] * (qn @ S) + _causal(decay * (qn @ kn.transpose(0, 2, 1)), w)
    to_end = decay[:, -1, :, None] * kn                                   # d_cj kn_j  [Hv,c,Dk]
    S *= gamma[:, -1, None, None]
    S += to_end.transpose(0, 2, 1) @ w
    return out


def ref_chunked(q, k, v, a, b, A_log, dt_bias, states, seq_slots, seq_starts, out=None):
    """``ref``'s contract in the chunked form: each sequence in chunks of CHUNK tokens (the last
    one shorter), each chunk one WY/UT transform with a triangular solve (``_chunk``), the state
    carried from chunk to chunk. Equal to ``ref`` within float32 rounding: the tests hold it to
    atol 2e-5 + rtol 1e-4 on outputs and states, at T = 1..200 from zero and non-zero states."""
    _check(q, k, v, a, b, states, seq_slots, seq_starts)
    qn, kn = (x.transpose(1, 0, 2) for x in normed(q, k, v.shape[1]))    # [Hv,T,Dk]
    g, beta = (x.T for x in gates(a, b, A_log, dt_bias))                  # [Hv,T]
    vt = v.astype(np.float32).transpose(1, 0, 2)
    res = np.zeros(v.shape, np.float32)
    for s in range(seq_slots.shape[0]):
        S = states[seq_slots[s]]
        for c0 in range(seq_starts[s], seq_starts[s + 1], CHUNK):
            c = slice(c0, min(c0 + CHUNK, seq_starts[s + 1]))
            res[c] = _chunk(S, qn[:, c], kn[:, c], vt[:, c], g[:, c], beta[:, c]).transpose(1, 0, 2)
    if out is None:
        return res
    out[...] = res
    return out


# --- cpu (numba: freetoken/kernels/_gdn_cpu.py, _gdn_chunked.py) ---------------------------------

# Runs of at least CHUNKED_MIN_T tokens take the chunked kernel, shorter ones (decode) the
# recurrent one; None: the recurrent kernel at every length. None because on the 2-core AVX2
# dev box the recurrent kernel is as fast at T = 512 and 15-20% faster at T = 2048
# (bench/gdn.py): the chunked form does ~1.4x the multiply-adds of the recurrence, which only
# GEMM-grade throughput would repay. The tests run both with 64.
CHUNKED_MIN_T = None


def _validate(states, seq_slots, seq_starts, T):
    """The numba kernels index without bounds checks: refuse bad rows or token ranges here."""
    B = seq_slots.shape[0]
    if B and (seq_slots.min() < 0 or seq_slots.max() >= states.shape[0]):
        raise IndexError(f"gdn_rule: a seq_slot outside [0, {states.shape[0]})")
    if np.unique(seq_slots).size != B:
        raise ValueError("gdn_rule: two sequences share a state row")
    if seq_starts[0] < 0 or seq_starts[-1] > T or (np.diff(seq_starts) < 0).any():
        raise IndexError(f"gdn_rule: seq_starts not a non-decreasing split of [0, {T}]")


def cpu(q, k, v, a, b, A_log, dt_bias, states, seq_slots, seq_starts, out=None):
    """Same contract as ``ref``. Each sequence takes the recurrent or the chunked kernel by its
    length (CHUNKED_MIN_T); both run parallel over (sequence, value head).
    ``states`` must be C-contiguous float32 (it is written in place); tokens outside every
    sequence are left unwritten."""
    from freetoken.kernels import _gdn_chunked, _gdn_cpu
    _check(q, k, v, a, b, states, seq_slots, seq_starts)
    assert states.dtype == np.float32 and states.flags.c_contiguous, (states.dtype, states.strides)
    q, k, v, a, b, A_log, dt_bias = (np.ascontiguousarray(x, np.float32)
                                     for x in (q, k, v, a, b, A_log, dt_bias))
    slots, starts = (np.ascontiguousarray(x, np.int32) for x in (seq_slots, seq_starts))
    _validate(states, slots, starts, q.shape[0])
    if out is None:
        out = np.empty(v.shape, np.float32)
    assert out.shape == v.shape and out.dtype == np.float32 and out.flags.c_contiguous, out.shape
    lens = np.diff(starts)
    chunked = lens >= (CHUNKED_MIN_T or np.iinfo(np.int32).max)
    short = np.flatnonzero((lens > 0) & ~chunked).astype(np.int32)
    long_ = np.flatnonzero((lens > 0) & chunked).astype(np.int32)
    inputs = (q, k, v, a, b, A_log, dt_bias, states, slots, starts)
    if short.size:
        _gdn_cpu.recurrent(*inputs, short, out)
    if long_.size:
        _gdn_chunked.chunked(*inputs, long_, CHUNK, out)
    return out


# --- gpu (cuda/gdn_rule.cu) ----------------------------------------------------------------------

ROWS_PER_THREAD = 16  # GDN_RPT in gdn_rule.cu: a thread keeps 16 state values in registers
COLS = 32             # state columns per block: a warp's lanes

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "gdn_rule_f32": ("q:f32*", "k:f32*", "v:f32*", "a:f32*", "b:f32*", "A_log:f32*",
                     "dt_bias:f32*", "states:f32*", "seq_slots:i32*", "seq_starts:i32*",
                     "out:f32*", "Hk:i32", "Hv:i32", "Dk:i32", "Dv:i32"),
}


def max_key_dim() -> int:
    """The largest Dk gdn_rule.gpu launches: a warp per ROWS_PER_THREAD state rows, as many
    warps as the loaded kernel's registers let a block hold, as the device says (CuPy's
    max_threads_per_block: 512 threads, Dk 256, on an H200, which refused the 544 an older rule
    allowed); the emulated device answers from cuda/launch_limits.json (device_limits). Not
    cached: a device attribute read (about a microsecond), and tests swap the kernel."""
    from freetoken.kernels import _cuda
    threads = _cuda.kernel("gdn_rule", "gdn_rule_f32").max_threads_per_block
    return threads // 32 * ROWS_PER_THREAD


def gpu(q, k, v, a, b, A_log, dt_bias, states, seq_slots, seq_starts, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,Hv,Dv] is required. One block per
    (32-column tile, value head, sequence), looping the sequence's tokens with the tile of the
    state in registers (see cuda/gdn_rule.cu). No host synchronisation: seq_slots and seq_starts
    are read on the device, so they are not validated (capture-safe)."""
    from freetoken.kernels import _cuda
    _check(q, k, v, a, b, states, seq_slots, seq_starts)
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    B = seq_slots.shape[0]
    assert out.shape == v.shape, ("out", out.shape, v.shape)
    assert A_log.shape == dt_bias.shape == (Hv,), (A_log.shape, dt_bias.shape, Hv)
    if not 0 < Dk <= max_key_dim() or Dv <= 0:
        raise ValueError(f"gdn_rule.gpu: key head dim {Dk} (value {Dv}); the kernel takes 1 to "
                         f"{max_key_dim()}: a block of 32 * ceil(Dk/{ROWS_PER_THREAD}) threads "
                         "must fit a block's 64K registers at the loaded kernel's count")
    if B == 0 or T == 0:
        return out
    args = _cuda.bind(ARGS["gdn_rule_f32"], q=q, k=k, v=v, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, states=states, seq_slots=seq_slots, seq_starts=seq_starts,
                      out=out, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv)
    block = 32 * -(-Dk // ROWS_PER_THREAD)
    _cuda.launch(_cuda.kernel("gdn_rule", "gdn_rule_f32"), (-(-Dv // COLS), Hv, B), (block,), args)
    return out
