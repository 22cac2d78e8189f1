"""gdn_conv: ref against float64 transcriptions of torch's conv1d semantics (a new sequence: K-1
zeros of left padding; a continuing one: the state concatenated before the inputs, as
transformers' torch_causal_conv1d_update), state continuity across calls, varlen batches with
shuffled slots and sequences shorter than K-1, bf16 weights; cpu vs ref throughout."""
import numpy as np
import pytest

from freetoken.kernels import gdn_conv
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close

TOL = dict(atol=1e-5, rtol=1e-5)


def varlen_args(rng, lens, C, K, N, dtype="bf16"):
    """(x, weight, conv_states, seq_slots, seq_starts): sequence b has lens[b] tokens and the
    shuffled slot seq_slots[b] of N; every state row random (as for continuing sequences)."""
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = rng.standard_normal((int(starts[-1]), C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    states = rng.standard_normal((N, K - 1, C)).astype(np.float32)
    slots = rng.permutation(N)[:len(lens)].astype(np.int32)
    return x, (from_f32(w) if dtype == "bf16" else w), states, slots, starts


def silu64(a):
    return a / (1.0 + np.exp(-a))


def torch_new_sequence(x, w):
    """F.silu(F.conv1d(x.T[None], w[:, None, :], padding=K-1, groups=C)[..., :n]), in float64:
    conv1d is a cross-correlation, so out[t] = sum_j w[:, j] * xpad[t + j]."""
    n, K = x.shape[0], w.shape[1]
    xpad = np.concatenate([np.zeros((K - 1, x.shape[1])), x.astype(np.float64)])
    return np.stack([silu64((w * xpad[t:t + K].T).sum(1)) for t in range(n)])


def torch_update(x, state, w):
    """torch_causal_conv1d_update with a K-1 state: cat(state, x) convolved without padding,
    the last n outputs; the new state is the last K-1 columns of the concatenation."""
    n, K = x.shape[0], w.shape[1]
    cat = np.concatenate([state.astype(np.float64), x.astype(np.float64)])
    out = [silu64((w * cat[t:t + K].T).sum(1)) for t in range(cat.shape[0] - K + 1)]
    return np.array(out[len(out) - n:]).reshape(n, x.shape[1]), cat[cat.shape[0] - (K - 1):]


def both(args):
    """(ref out, ref states), (cpu out, cpu states) on copies of the same inputs."""
    x, w, states, slots, starts = args
    s_ref, s_cpu = states.copy(), states.copy()
    return ((gdn_conv.ref(x, w, s_ref, slots, starts), s_ref),
            (gdn_conv.cpu(x, w, s_cpu, slots, starts), s_cpu))


@pytest.mark.parametrize("fn", [gdn_conv.ref, gdn_conv.cpu], ids=["ref", "cpu"])
@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_new_sequence_is_torch_conv1d_with_left_padding(fn, n):
    x, w, states, _, _ = varlen_args(np.random.default_rng(n), [n], 24, 4, 1, "f32")
    states[:] = 0
    got = fn(x, w, states, np.array([0], np.int32), np.array([0, n], np.int32))
    assert_close(f"gdn_conv new n{n}", torch_new_sequence(x, w), got, **TOL)
    keep = min(n, 3)                                   # the state: last inputs, zeros before
    np.testing.assert_array_equal(states[0, 3 - keep:], x[n - keep:])
    np.testing.assert_array_equal(states[0, :3 - keep], 0)


@pytest.mark.parametrize("fn", [gdn_conv.ref, gdn_conv.cpu], ids=["ref", "cpu"])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_varlen_batch_is_torch_update_per_sequence(fn, dtype):
    """Lengths 0, 1 and 2 (< K-1: the state keeps its older entries) beside longer ones; slots
    shuffled; the rows no sequence names are untouched."""
    lens = [5, 1, 0, 2, 7, 3]
    x, w, states, slots, starts = varlen_args(np.random.default_rng(7), lens, 40, 4, 9, dtype)
    before = states.copy()
    got = fn(x, w, states, slots, starts)
    for b, slot in enumerate(slots):
        s, e = starts[b], starts[b + 1]
        expect, new_state = torch_update(x[s:e], before[slot], to_f32(w))
        assert_close(f"seq {b} out", expect, got[s:e], **TOL)
        np.testing.assert_array_equal(states[slot], new_state.astype(np.float32))
    unused = np.setdiff1d(np.arange(9), slots)
    np.testing.assert_array_equal(states[unused], before[unused])


@pytest.mark.parametrize("split", [1, 2, 3, 5, 10])
def test_two_calls_equal_one(split):
    """A sequence run as split tokens then the rest continues exactly from the saved state."""
    x, w, states, _, _ = varlen_args(np.random.default_rng(split), [11], 33, 4, 2)
    slot, one = np.array([1], np.int32), states.copy()
    whole = gdn_conv.cpu(x, w, one, slot, np.array([0, 11], np.int32))
    two = states.copy()
    first = gdn_conv.cpu(x[:split], w, two, slot, np.array([0, split], np.int32))
    rest = gdn_conv.cpu(x[split:], w, two, slot, np.array([0, 11 - split], np.int32))
    assert_close("two calls", whole, np.concatenate([first, rest]), 1e-6, 1e-6)
    np.testing.assert_array_equal(two, one)


@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_cpu_matches_ref(K, dtype):
    lens = [3, 0, 1, 70, 2, 1]
    args = varlen_args(np.random.default_rng(K), lens, 1100, K, 8, dtype)
    (ref_out, ref_st), (cpu_out, cpu_st) = both(args)
    assert_close(f"gdn_conv K{K}", ref_out, cpu_out, **TOL)
    np.testing.assert_array_equal(cpu_st, ref_st)


def test_decode_qwen36_shape():
    """Qwen3.6 decode: 16 sequences of one token over 8192 channels, out into a given array."""
    args = varlen_args(np.random.default_rng(3), [1] * 16, 8192, 4, 32)
    (ref_out, ref_st), _ = both(args)
    x, w, states, slots, starts = args
    out = np.full_like(x, np.nan)
    assert gdn_conv.cpu(x, w, states, slots, starts, out) is out
    assert_close("gdn_conv decode", ref_out, out, **TOL)
    np.testing.assert_array_equal(states, ref_st)


def test_cpu_refuses_bad_batches():
    x, w, states, slots, starts = varlen_args(np.random.default_rng(0), [2, 3], 16, 4, 4)
    with pytest.raises(ValueError, match="two sequences"):
        gdn_conv.cpu(x, w, states, np.array([1, 1], np.int32), starts)
    with pytest.raises(IndexError):
        gdn_conv.cpu(x, w, states, np.array([0, 4], np.int32), starts)
    with pytest.raises(ValueError, match="0 to T"):
        gdn_conv.cpu(x, w, states, slots, np.array([0, 2, 4], np.int32))
    with pytest.raises(ValueError, match="decrease"):
        gdn_conv.cpu(x, w, states, slots, np.array([0, 6, 5], np.int32))


def test_prefill_runs_the_parallel_driver():
    """T*C over PARALLEL_MIN: the parallel driver, with short and long sequences mixed."""
    lens = [40, 2, 27, 1]
    assert sum(lens) * 8192 >= gdn_conv.PARALLEL_MIN
    (ref_out, ref_st), (cpu_out, cpu_st) = both(varlen_args(np.random.default_rng(11), lens,
                                                            8192, 4, 6))
    assert_close("gdn_conv prefill", ref_out, cpu_out, **TOL)
    np.testing.assert_array_equal(cpu_st, ref_st)


def with_bad_inputs(bad):
    """(args, out mask, state mask): a varlen batch (K = 4) with ``bad`` at x[t, 7] inside
    sequence 1, in the state entry sequence 2 reads (then drops: it brings 2 tokens), and at
    sequence 3's one token, which its state row keeps; the masks say where the rule puts it."""
    args = varlen_args(np.random.default_rng(12), [3, 70, 2, 1], 40, 4, 6, "f32")
    x, _, states, slots, starts = args
    out, rows = np.zeros(x.shape, bool), np.zeros(states.shape, bool)
    t = starts[1] + 5
    x[t, 7], out[t:t + 4, 7] = bad, True                     # the K windows holding it
    states[slots[2], 1, 9], out[starts[2]:starts[2] + 2, 9] = bad, True
    x[starts[3], 11], out[starts[3], 11], rows[slots[3], 2, 11] = bad, True, True
    return args, out, rows


def assert_follows(got, want):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], **TOL)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_stays_in_its_window(bad):
    """The op only sums a channel's K taps over time: a NaN or inf reaches the outputs whose
    window holds it and the state row that keeps it, nothing in another channel or sequence
    (ref's rule, in gdn_conv's docstring), and cpu follows ref there."""
    args, out_mask, rows_mask = with_bad_inputs(bad)
    with np.errstate(all="ignore"):                          # w * inf, silu(-inf) = -inf / inf
        (want, want_states), (got, states) = both(args)
    np.testing.assert_array_equal(~np.isfinite(want), out_mask)
    np.testing.assert_array_equal(~np.isfinite(want_states), rows_mask)
    assert_follows(got, want)
    assert_follows(states, want_states)
