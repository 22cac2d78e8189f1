"""gdn_rule: ref against a float64 transcription of the recurrence; ref_chunked equal to ref
across chunk edges, from zero and non-zero states, with GVA and without; cpu (recurrent and
chunked paths) against ref on decode and prefill shapes, varlen batches and shuffled slots."""
import numpy as np
import pytest

from freetoken.kernels import gdn_rule

TOL = dict(atol=2e-5, rtol=1e-4)   # float32 rounding of two different summation orders


def random_args(rng, lens, Hk=2, Hv=4, Dk=16, Dv=8, N=None, init=0.5, decay=1.0):
    """The op's arguments for sequences of ``lens`` tokens (tokens laid out sequence after
    sequence), state rows drawn in shuffled order from N >= len(lens) rows, states of scale
    ``init`` (0: fresh sequences), A = exp(A_log) scaled by ``decay``."""
    N = N or len(lens) + 2
    T = int(sum(lens))
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    A_log = np.log(rng.uniform(0.5, 16, Hv) * decay).astype(np.float32)
    dt_bias = (f(Hv) - 2).astype(np.float32)
    a = f(T, Hv) * 3
    a[:, 0] = 25                                     # softplus past its threshold: linear
    states = f(N, Hv, Dk, Dv) * np.float32(init)
    slots = rng.permutation(N)[:len(lens)].astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return [f(T, Hk, Dk), f(T, Hk, Dk), f(T, Hv, Dv), a, f(T, Hv) * 2, A_log, dt_bias, states,
            slots, starts]


def run(fn, args, out=None):
    """(out, states after) of one call on a copy of the states."""
    args = list(args)
    args[7] = args[7].copy()
    res = fn(*args, out) if out is not None else fn(*args)
    return res, args[7]


def transcription(args):
    """The contract's per-token recurrence in float64, one token and head at a time."""
    q, k, v, a, b, A_log, dt_bias, states, slots, starts = args
    Hk, Dk, Hv = q.shape[1], q.shape[2], v.shape[1]
    S_all = states.astype(np.float64)
    out = np.zeros(v.shape)
    for s, slot in enumerate(slots):
        for t in range(starts[s], starts[s + 1]):
            for h in range(Hv):
                kh = h // (Hv // Hk)
                q64, k64 = q[t, kh].astype(np.float64), k[t, kh].astype(np.float64)
                qn = q64 / np.sqrt((q64 ** 2).sum() + 1e-6) / np.sqrt(Dk)
                kn = k64 / np.sqrt((k64 ** 2).sum() + 1e-6)
                x = float(a[t, h]) + float(dt_bias[h])
                g = -np.exp(float(A_log[h])) * (x if x > 20 else np.log1p(np.exp(x)))
                beta = 1 / (1 + np.exp(-float(b[t, h])))
                S = S_all[slot, h]
                S *= np.exp(g)
                S += np.outer(kn, beta * (v[t, h] - S.T @ kn))
                out[t, h] = S.T @ qn
    return out, S_all


@pytest.mark.parametrize("lens,Hk,Hv", [([1], 1, 1), ([3], 2, 4), ([2, 5, 1], 2, 2),
                                        ([7, 4], 1, 3)])
def test_ref_matches_float64_transcription(lens, Hk, Hv):
    args = random_args(np.random.default_rng(len(lens) * 10 + Hv), lens, Hk, Hv, Dk=8, Dv=5)
    expect, expect_states = transcription(args)
    out, states = run(gdn_rule.ref, args)
    np.testing.assert_allclose(out, expect, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(states, expect_states, atol=1e-6, rtol=1e-5)


def test_ref_writes_out_and_leaves_unused_rows():
    args = random_args(np.random.default_rng(1), [4, 2], N=5)
    out = np.full(args[2].shape, np.nan, np.float32)
    res, states = run(gdn_rule.ref, args, out)
    assert res is out and np.isfinite(out).all()
    unused = np.setdiff1d(np.arange(5), args[8])
    np.testing.assert_array_equal(states[unused], args[7][unused])


CHUNK_CASES = [([1], 2, 4), ([63], 2, 4), ([64], 2, 2), ([65], 2, 4), ([200], 2, 4),
               ([200], 4, 4), ([5, 130, 64, 1, 65], 2, 4)]


@pytest.mark.parametrize("init", [0.0, 0.5])
@pytest.mark.parametrize("lens,Hk,Hv", CHUNK_CASES)
def test_ref_chunked_equals_ref(lens, Hk, Hv, init):
    args = random_args(np.random.default_rng(sum(lens) + Hv), lens, Hk, Hv, init=init)
    expect, expect_states = run(gdn_rule.ref, args)
    out, states = run(gdn_rule.ref_chunked, args)
    np.testing.assert_allclose(out, expect, **TOL)
    np.testing.assert_allclose(states, expect_states, **TOL)


@pytest.mark.parametrize("decay", [1e-3, 30.0])
def test_ref_chunked_long_memory_and_strong_decay(decay):
    """Almost no decay (the state sums 200 writes) and decays of ~-70 per token (a chunk's
    cumulative log decay in the thousands: segment sums keep the decays exact) at Dk = Dv = 128."""
    args = random_args(np.random.default_rng(3), [200, 70], 2, 4, 128, 128, decay=decay)
    expect, expect_states = run(gdn_rule.ref, args)
    out, states = run(gdn_rule.ref_chunked, args)
    np.testing.assert_allclose(out, expect, **TOL)
    np.testing.assert_allclose(states, expect_states, **TOL)


@pytest.mark.parametrize("fn", [gdn_rule.ref, gdn_rule.ref_chunked, gdn_rule.cpu])
@pytest.mark.parametrize("lens", [[], [0], [0, 3, 0]])
def test_empty_batch_and_empty_sequences(fn, lens):
    args = random_args(np.random.default_rng(2), lens, N=4)
    out, states = run(fn, args)
    assert out.shape == (sum(lens), 4, 8)
    empty = args[8][np.diff(args[9]) == 0]
    np.testing.assert_array_equal(states[empty], args[7][empty])   # an empty sequence: no decay
    if sum(lens):
        expect, _ = run(gdn_rule.ref, args)
        np.testing.assert_allclose(out, expect, **TOL)


# --- cpu ------------------------------------------------------------------------------------------

def check_cpu(args, out=None):
    """cpu == ref on outputs and every state row (unused rows bit for bit untouched)."""
    expect, expect_states = run(gdn_rule.ref, args)
    got, states = run(gdn_rule.cpu, args, out)
    np.testing.assert_allclose(got, expect, **TOL)
    np.testing.assert_allclose(states, expect_states, **TOL)
    unused = np.setdiff1d(np.arange(states.shape[0]), args[8])
    np.testing.assert_array_equal(states[unused], args[7][unused])
    return got


@pytest.fixture(params=["recurrent", "chunked"])
def form(request, monkeypatch):
    """Runs the cpu tests with long runs taken by each kernel in turn."""
    monkeypatch.setattr(gdn_rule, "CHUNKED_MIN_T", 64 if request.param == "chunked" else None)
    return request.param


@pytest.mark.parametrize("B,Hk,Hv,Dk,Dv", [(1, 16, 32, 128, 128), (4, 16, 32, 128, 128),
                                           (16, 16, 32, 128, 128), (3, 2, 2, 24, 40),
                                           (5, 1, 3, 37, 5)])
def test_cpu_decode(B, Hk, Hv, Dk, Dv):
    args = random_args(np.random.default_rng(B * Dk), [1] * B, Hk, Hv, Dk, Dv, N=2 * B + 1)
    out = np.full(args[2].shape, np.nan, np.float32)           # poisoned: every row written
    assert check_cpu(args, out) is out


@pytest.mark.parametrize("lens", [[64], [65], [200], [130, 1, 0, 64, 63, 7], [1, 129]])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 24, 16), (3, 3, 24, 16), (1, 2, 37, 5)])
def test_cpu_prefill_varlen(lens, Hk, Hv, Dk, Dv, form):
    check_cpu(random_args(np.random.default_rng(sum(lens) + Hv), lens, Hk, Hv, Dk, Dv))


@pytest.mark.parametrize("init", [0.0, 0.5])
def test_cpu_prefill_qwen_shape(init, form):
    """Qwen3.6's GDN heads (Hk 16, Hv 32, Dk = Dv = 128) over two chunk edges, a decode
    sequence in the same batch."""
    check_cpu(random_args(np.random.default_rng(7), [130, 1], 16, 32, 128, 128, init=init))


@pytest.mark.parametrize("decay", [1e-3, 30.0])
def test_cpu_long_memory_and_strong_decay(decay, form):
    check_cpu(random_args(np.random.default_rng(4), [200, 3], 2, 4, 64, 32, decay=decay))


def test_cpu_takes_strided_inputs():
    args = random_args(np.random.default_rng(5), [3, 70], 2, 4, 16, 8)
    wide = np.repeat(args[0], 2, axis=2)                     # q as a strided view
    args[0] = wide[:, :, ::2]
    assert not args[0].flags.c_contiguous
    check_cpu(args)


def test_cpu_refuses_bad_slots_and_starts():
    args = random_args(np.random.default_rng(6), [2, 3], N=3)
    for i, bad, err in ((8, [0, 3], IndexError), (8, [1, 1], ValueError),
                        (9, [0, 3, 2], IndexError), (9, [0, 2, 6], IndexError)):
        broken = list(args)
        broken[i] = np.array(bad, np.int32)
        with pytest.raises(err):
            run(gdn_rule.cpu, broken)


# --- non-finite inputs (the rule in gdn_rule's module docstring) ---------------------------------

NON_FINITE = [  # (name, input: 0 q, 1 k, 2 v, 3 a, 4 b, where in the token's row, value, reach)
    ("q-nan", 0, (1, 3), np.nan, "token"), ("q-inf", 0, (1, 3), np.inf, "token"),
    ("k-nan", 1, (0, 2), np.nan, "heads"), ("k-inf", 1, (0, 2), -np.inf, "heads"),
    ("v-nan", 2, (2, 5), np.nan, "column"), ("v-inf", 2, (2, 5), np.inf, "column"),
    ("a-nan", 3, (1,), np.nan, "heads"), ("b-nan", 4, (2,), np.nan, "heads"),
    ("a+inf", 3, (1,), np.inf, None), ("a-inf", 3, (1,), -np.inf, None),
    ("b+inf", 4, (2,), np.inf, None), ("b-inf", 4, (2,), -np.inf, None),
    ("q-overflow", 0, (0, 1), 1e30, None), ("k-overflow", 1, (1, 0), 1e30, None),
]
NON_FINITE_LENS = [3, 70, 2]   # sequence 1 crosses a chunk edge, 2 is always the recurrent kernel's


def clean_batch():
    """NON_FINITE_LENS's batch (Hk 2, Hv 4), every input finite."""
    return random_args(np.random.default_rng(11), NON_FINITE_LENS, 2, 4, 16, 8)


def with_bad_input(case, s):
    """(args, t): ``clean_batch`` with ``case``'s value at token t of sequence s (its 11th
    token, or its last)."""
    _, inp, where, value, _ = case
    args = clean_batch()
    t = int(args[9][s]) + min(10, NON_FINITE_LENS[s] - 1)
    args[inp][(t,) + where] = value
    return args, t


def reach(args, case, s, t):
    """The rule: masks of the outputs and state entries that turn non-finite."""
    _, inp, where, _, scope = case
    v, states, slots, starts = args[2], args[7], args[8], args[9]
    out, rows = np.zeros(v.shape, bool), np.zeros(states.shape, bool)
    rep = v.shape[1] // args[0].shape[1]
    heads = slice(where[0] * rep, (where[0] + 1) * rep) if inp < 2 else where[0]
    end, row = starts[s + 1], rows[slots[s]]
    if scope == "token":
        out[t, heads] = True
    elif scope == "heads":
        out[t:end, heads], row[heads] = True, True
    elif scope == "column":
        out[t:end, heads, where[1]], row[heads, :, where[1]] = True, True
    return out, rows


def nan_exact(case):
    """Whether the rule's non-finite entries are all NaN: all but an inf in v's."""
    return not (case[1] == 2 and np.isinf(case[3]))


def assert_follows(got, want, case):
    """Non-finite where ``want`` is, NaN where it is NaN (bar an inf in v: NaN or inf by
    summation order), the finite entries within TOL."""
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    if nan_exact(case):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], **TOL)


def ref_on_bad_input(case, s):
    """(args, t, out, states) of ref on ``with_bad_input``."""
    args, t = with_bad_input(case, s)
    with np.errstate(all="ignore"):                  # inf - inf, inf * 0: the rule's NaNs
        out, states = run(gdn_rule.ref, args)
    return args, t, out, states


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("case", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_ref_non_finite_rule(case, s):
    """The rule written in gdn_rule's docstring, read off ref: what turns non-finite, and that
    nothing else moves: other sequences and rows, the sequence before t, its other heads (or
    columns) come out bit for bit as in the clean run."""
    args, t, out, states = ref_on_bad_input(case, s)
    want_out, want_rows = reach(args, case, s, t)
    np.testing.assert_array_equal(~np.isfinite(out), want_out)
    np.testing.assert_array_equal(~np.isfinite(states), want_rows)
    if nan_exact(case):
        np.testing.assert_array_equal(np.isnan(out), want_out)
        np.testing.assert_array_equal(np.isnan(states), want_rows)
    clean_out, clean_states = run(gdn_rule.ref, clean_batch())
    same, same_rows = ~want_out, ~want_rows
    if case[4] is None:                 # a finite limit: the sequence from t on differs, rightly
        same[t:args[9][s + 1]], same_rows[args[8][s]] = False, False
    np.testing.assert_array_equal(out[same], clean_out[same])
    np.testing.assert_array_equal(states[same_rows], clean_states[same_rows])


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("case", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_ref_chunked_follows_ref_on_non_finite_inputs(case, s):
    """A product over whole chunk rows once took 0 * NaN from the tokens after a NaN and spoilt
    the chunk's earlier outputs; the chunked kernels' spec must keep them as ref does."""
    args, _, want, want_states = ref_on_bad_input(case, s)
    with np.errstate(all="ignore"):
        out, states = run(gdn_rule.ref_chunked, args)
    assert_follows(out, want, case)
    assert_follows(states, want_states, case)


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("case", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_cpu_follows_ref_on_non_finite_inputs(case, s, form):
    """Both kernels: a NaN gate was flushed to a decay of 0 (``g > LOG_FLOOR`` is false for NaN),
    which wiped the state, so the NaN vanished and the sequence's outputs came back finite."""
    args, _, want, want_states = ref_on_bad_input(case, s)
    out, states = run(gdn_rule.cpu, args, np.full(want.shape, 7.0, np.float32))
    assert_follows(out, want, case)
    assert_follows(states, want_states, case)
