"""penalties: a hand-computed batch for ref and cpu, then cpu vs ref bit for bit on random
batches (N = 0, B = 1, odd V, in place, both repetition branches)."""
import numpy as np
import pytest

from freetoken.kernels import penalties

IMPLS = [penalties.ref, penalties.cpu]


def entries(rng, B, V, N):
    """rows, tokens int32[N]: N distinct (row, token) pairs spread over the batch, shuffled."""
    flat = rng.choice(B * V, N, replace=False)
    return (flat // V).astype(np.int32), (flat % V).astype(np.int32)


def random_args(rng, B, V, N, scale=4.0):
    """The op's arguments: logits of both signs (and exact zeros), every penalty off or on per
    row, repetition above and below 1, counts 0 with and without the prompt flag, sparse bias."""
    logits = (rng.standard_normal((B, V)) * scale).astype(np.float32)
    logits[rng.random((B, V)) < 0.01] = 0.0
    rows, tokens = entries(rng, B, V, N)
    counts = np.where(rng.random(N) < 0.3, 0, rng.integers(1, 300, N)).astype(np.int32)
    prompt = (rng.random(N) < 0.5).astype(np.int32)
    bias = np.where(rng.random(N) < 0.5, rng.uniform(-100, 100, N), 0.0).astype(np.float32)
    presence = rng.choice([0.0, 0.5, 1.7, -0.3], B).astype(np.float32)
    frequency = rng.choice([0.0, 0.1, 0.37, 2.0], B).astype(np.float32)
    repetition = rng.choice([1.0, 1.05, 1.3, 0.7], B).astype(np.float32)
    return logits, rows, tokens, counts, prompt, bias, presence, frequency, repetition


def assert_bits(got, expect, any_nan=False):
    """Equal bits; with ``any_nan`` a NaN matches any NaN (a GPU writes its canonical NaN where
    x86 propagates the operand's payload)."""
    assert got.dtype == np.float32 and got.shape == expect.shape
    both_nan = np.isnan(got) & np.isnan(expect) if any_nan else np.zeros(got.shape, bool)
    np.testing.assert_array_equal(np.where(both_nan, 0, got.view(np.uint32)),
                                  np.where(both_nan, 0, expect.view(np.uint32)))


@pytest.mark.parametrize("impl", IMPLS)
def test_by_hand(impl):
    logits = np.array([[2.0, -2.0, 3.0, 0.0, 5.0], [1.0] * 5], np.float32)
    i32, f32 = (lambda *v: np.array(v, np.int32)), (lambda *v: np.array(v, np.float32))  # noqa: E731
    rows, tokens = i32(0, 0, 0, 0, 1), i32(0, 1, 2, 3, 4)
    counts, prompt = i32(1, 0, 0, 2, 3), i32(0, 1, 0, 0, 1)
    out = impl(logits, rows, tokens, counts, prompt, f32(0, 0, 10, 0, -100),
               f32(1.0, 0.0), f32(0.5, 0.25), f32(2.0, 1.0))
    # (0,0) seen: 2/2 - 0.5 - 1; (0,1) prompt only: -2*2, no frequency/presence; (0,2) unseen:
    # bias only; (0,3) z = 0 takes z*r; (1,4) repetition 1 is off: 1 - 0.25*3 - 100
    expect = np.array([[-0.5, -4.0, 13.0, -2.0, 5.0], [1, 1, 1, 1, -99.75]], np.float32)
    assert_bits(out, expect)
    assert logits[0, 0] == 2.0                      # out=None leaves the logits alone


@pytest.mark.parametrize("B,V,N", [(1, 1, 1), (1, 7, 0), (1, 1001, 500), (3, 33, 99),
                                   (5, 4099, 2000), (8, 151936, 2048)])
def test_cpu_matches_ref_bit_for_bit(B, V, N):
    rng = np.random.default_rng(B * V + N)
    args = random_args(rng, B, V, N)
    expect = penalties.ref(*args)
    assert_bits(penalties.cpu(*args), expect)
    out = np.full((B, V), np.nan, np.float32)
    assert penalties.cpu(*args, out=out) is out
    assert_bits(out, expect)


@pytest.mark.parametrize("N", [0, 1, 300])
def test_cpu_in_place(N):
    rng = np.random.default_rng(N)
    args = random_args(rng, 4, 1000, N)
    expect = penalties.ref(*args)
    logits = args[0].copy()
    assert penalties.cpu(logits, *args[1:], out=logits) is logits
    assert_bits(logits, expect)


def test_every_entry_of_a_full_row_and_both_repetition_branches():
    """Every token of two rows adjusted (each pair once), repetition on: positive logits are
    divided, the rest multiplied, and rounding lands where ref's does at extreme magnitudes."""
    rng = np.random.default_rng(7)
    B, V = 2, 3001
    args = list(random_args(rng, B, V, B * V, scale=1e3))
    args[4][:] = 1                                 # every token in the prompt: all seen
    args[8][:] = np.float32([1.3, 0.7])
    expect = penalties.ref(*args)
    z = args[0][args[1], args[2]]
    assert (z > 0).any() and (z < 0).any() and (z == 0).any()
    assert_bits(penalties.cpu(*args), expect)


def test_cases_are_sensitive_to_fma():
    """z - f*c rounded once (what a fused multiply-add gives) differs from ref's two roundings
    for many random entries, so the bit-exact checks here would catch a contraction."""
    rng = np.random.default_rng(3)
    z, f = rng.standard_normal(4096).astype(np.float32) * 8, rng.random(4096).astype(np.float32)
    c = rng.integers(1, 300, 4096).astype(np.float32)
    fused = (z.astype(np.float64) - f.astype(np.float64) * c).astype(np.float32)
    assert (fused != z - f * c).mean() > 0.05


def special_args():
    """Infinite and NaN logits, a repetition of 0 (z/0 = inf) and a NaN repetition, infinite bias."""
    rng = np.random.default_rng(9)
    args = list(random_args(rng, 4, 64, 256))                # every logit adjusted
    args[0][:, :8] = np.float32([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-3, -1e-3, 3e38])
    args[5][:4] = np.float32([np.inf, -np.inf, 1e38, -1e38])
    args[8][:] = np.float32([0.0, np.nan, 1.0, 1e-30])
    return args


def test_cpu_matches_ref_on_special_values():
    args = special_args()
    with np.errstate(all="ignore"):
        expect = penalties.ref(*args)
    assert np.isposinf(expect[0]).any() and np.isnan(expect).any()
    assert_bits(penalties.cpu(*args), expect)


def test_cpu_refuses_an_out_of_range_entry():
    args = list(random_args(np.random.default_rng(0), 2, 10, 3))
    args[2] = np.array([0, 1, 10], np.int32)
    with pytest.raises(IndexError):
        penalties.cpu(*args)
