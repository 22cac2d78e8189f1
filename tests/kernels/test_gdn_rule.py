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
    """The contract's per-token recurrence in float64, one head and one scalar at a time."""
    q, k, v, a, b, A_log, dt_bias, states, slots, starts = args
    Hk, Dk, Hv = q.shape[1], q.shape[2], v.shape[1]
    S_all = states.astype(np.float64)
    out = np.zeros(v.shape)
    for s, slot in enumerate(slots):
        for t in range(starts[s], starts[s + 1]):
            for h in range(Hv):
                kh = h // (Hv // Hk)
                qn = q[t, kh] / np.sqrt((q[t, kh].astype(np.float64) ** 2).sum() + 1e-6) / np.sqrt(Dk)
                kn = k[t, kh] / np.sqrt((k[t, kh].astype(np.float64) ** 2).sum() + 1e-6)
                x = float(a[t, h]) + float(dt_bias[h])
                g = -np.exp(float(A_log[h])) * (x if x > 20 else np.log1p(np.exp(x)))
                beta = 1 / (1 + np.exp(-float(b[t, h])))
                S = S_all[slot, h]
                S *= np.exp(g)
                S += np.outer(kn, beta * (v[t, h] - S.T @ kn))
                out[t, h] = S.T @ qn
    return out, S_all


@pytest.mark.parametrize("lens,Hk,Hv", [([1], 1, 1), ([3], 2, 4), ([2, 5, 1], 2, 2), ([7, 4], 1, 3)])
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


def test_empty_batch_and_empty_sequences():
    for lens in ([], [0, 3, 0]):
        args = random_args(np.random.default_rng(2), lens, N=4)
        for fn in (gdn_rule.ref, gdn_rule.ref_chunked):
            out, states = run(fn, args)
            assert out.shape == (sum(lens), 4, 8)
        if lens:
            expect, _ = run(gdn_rule.ref, args)
            np.testing.assert_allclose(out, expect, **TOL)
