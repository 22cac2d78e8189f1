"""logprobs: a hand-computed row for ref and cpu, then cpu vs ref (top ids exactly, logprobs
within a few ulps) on random rows, ties, k = 0 and k = V, underflowing and huge logits, -inf
logits, the insertion's worst case; the cpu's exp against float64; argument errors."""
import numpy as np
import pytest

from freetoken.kernels import logprobs

IMPLS = [logprobs.ref, logprobs.cpu]
ATOL, RTOL = 1e-5, 1e-6     # RTOL: an ulp of |lp| where logits are 1e4 apart


def check_cpu(logits, chosen, k):
    """cpu against ref; returns ref's result."""
    expect = logprobs.ref(logits, chosen, k)
    got = logprobs.cpu(logits, chosen, k)
    np.testing.assert_array_equal(got[1], expect[1])
    np.testing.assert_allclose(got[0], expect[0], atol=ATOL, rtol=RTOL)   # -inf == -inf here
    np.testing.assert_allclose(got[2], expect[2], atol=ATOL, rtol=RTOL)
    return expect


def random_rows(rng, B, V, scale=3.0):
    return (rng.standard_normal((B, V)) * scale).astype(np.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_by_hand(impl):
    # p = 0.25, 0.125, 0.125, 0.5: order 3, 0, 1, 2 (the 0.125 tie -> id 1 first)
    logits = np.log(np.array([[0.25, 0.125, 0.125, 0.5]], np.float32)) + np.float32(7.0)
    lp_chosen, ids, lps = impl(logits, np.array([2], np.int32), 3)
    assert (lp_chosen.dtype, ids.dtype, lps.dtype) == (np.float32, np.int32, np.float32)
    np.testing.assert_array_equal(ids, [[3, 0, 1]])
    np.testing.assert_allclose(lps, np.log([[0.5, 0.25, 0.125]]), atol=1e-6)
    np.testing.assert_allclose(lp_chosen, np.log([0.125]), atol=1e-6)


@pytest.mark.parametrize("B,V,k", [(1, 1, 1), (1, 7, 3), (5, 64, 20), (3, 65, 20), (9, 1000, 20),
                                   (2, 5000, 32), (4, 151936, 20), (1, 151936, 1)])
def test_cpu_matches_ref(B, V, k):
    rng = np.random.default_rng(B * V + k)
    check_cpu(random_rows(rng, B, V), rng.integers(0, V, B).astype(np.int32), k)


@pytest.mark.parametrize("V", [40, 3000, 151936])
def test_ties_go_to_the_lower_id(V):
    """Integer logits tie everywhere; a flat row; the k-th place shared by many ids."""
    rng = np.random.default_rng(V)
    logits = np.round(random_rows(rng, 6, V))
    logits[1] = 0.0                                      # every id tied: 0..k-1
    logits[2, ::5] = logits[2].max()                     # the top is a tie of V/5 ids
    logits[3, : V // 2] = 1.0
    logits[3, rng.integers(0, V, 10)] = 2.0              # 10 ids, then the k-th among 1.0's
    expect = check_cpu(logits, rng.integers(0, V, 6).astype(np.int32), 20)
    np.testing.assert_array_equal(expect[1][1], np.arange(20))


@pytest.mark.parametrize("V", [1, 20, 1000])
def test_k_zero_and_k_equal_to_v(V):
    rng = np.random.default_rng(V)
    logits, chosen = random_rows(rng, 3, V), rng.integers(0, V, 3).astype(np.int32)
    expect = check_cpu(logits, chosen, 0)
    assert expect[1].shape == expect[2].shape == (3, 0)
    if V <= 32:
        check_cpu(logits, chosen, V)


def test_one_huge_logit_underflows_the_rest():
    rng = np.random.default_rng(1)
    logits = random_rows(rng, 3, 20000, 1.0)
    logits[:, 123] = [200.0, 90.0, 1e4]                  # exp(others - max) is 0 in float32
    chosen = np.array([123, 5, 77], np.int32)
    lp_chosen, ids, lps = check_cpu(logits, chosen, 5)
    assert (ids[:, 0] == 123).all() and (lps[:, 0] == 0.0).all() and lp_chosen[0] == 0.0


@pytest.mark.parametrize("scale", [1e2, 1e4])
def test_large_magnitude_logits(scale):
    rng = np.random.default_rng(2)
    logits = random_rows(rng, 4, 30000, scale)
    logits[1] += np.float32(5e4)                          # a shifted row: same logprobs
    check_cpu(logits, rng.integers(0, 30000, 4).astype(np.int32), 20)


def test_minus_inf_logits():
    """Masked-out tokens: lp -inf, last in the order (ties among them -> lower id)."""
    rng = np.random.default_rng(3)
    logits = random_rows(rng, 3, 700)
    logits[:, 10:] = -np.inf
    logits[2, :] = -np.inf
    logits[2, 400] = 0.0
    lp_chosen, ids, lps = check_cpu(logits, np.array([3, 50, 400], np.int32), 20)
    assert lp_chosen[1] == -np.inf and lp_chosen[2] == 0.0
    np.testing.assert_array_equal(ids[0, 10:], np.arange(10, 20))


def test_ascending_row_inserts_every_logit():
    """Each logit beats the list: the insertion's worst case, still exact."""
    V = 5000
    logits = np.stack([np.arange(V, dtype=np.float32) / 100, -np.arange(V, dtype=np.float32) / 100])
    check_cpu(logits, np.array([V - 1, 0], np.int32), 20)


def test_exp_against_float64():
    x = np.linspace(-86.9, 0.0, 200001, dtype=np.float32)
    for i in range(0, x.size - 64, 9973):               # 64-wide blocks and the scalar tail
        got = logprobs._sum_exp(x[i:i + 70], np.float32(0.0))
        want = np.exp(x[i:i + 70].astype(np.float64)).sum()
        assert abs(got - want) <= 2e-7 * want, (x[i], got, want)
    assert logprobs._sum_exp(np.array([-87.5, -1e30, -np.inf], np.float32), np.float32(0.0)) == 0.0


def test_out_is_written_and_returned():
    rng = np.random.default_rng(4)
    logits, chosen = random_rows(rng, 3, 300), np.array([0, 1, 299], np.int32)
    out = (np.full(3, np.nan, np.float32), np.full((3, 4), -7, np.int32),
           np.full((3, 4), np.nan, np.float32))
    assert logprobs.cpu(logits, chosen, 4, out) is out
    for a, b in zip(out, logprobs.ref(logits, chosen, 4)):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_cpu_argument_errors():
    logits = np.zeros((2, 10), np.float32)
    with pytest.raises(ValueError, match="k = 11 outside"):
        logprobs.cpu(logits, np.zeros(2, np.int32), 11)
    with pytest.raises(ValueError, match="chosen ids outside"):
        logprobs.cpu(logits, np.array([0, 10], np.int32), 2)
    with pytest.raises(ValueError, match="chosen must be"):
        logprobs.cpu(logits, np.zeros(3, np.int32), 2)
    empty = logprobs.cpu(np.zeros((0, 10), np.float32), np.zeros(0, np.int32), 3)
    assert empty[1].shape == (0, 3)


def non_finite_rows(V=50):
    """A NaN first, a +inf, a -inf among finite logits, all -inf, all NaN, and a finite row."""
    rows = np.tile(np.linspace(-1.0, 1.0, V, dtype=np.float32), (6, 1))
    rows[0, 0], rows[1, 3], rows[2, V - 1] = np.nan, np.inf, -np.inf
    rows[3], rows[4] = -np.inf, np.nan
    return rows, np.array([0, 3, V - 1, 0, 0, 7], np.int32)


def test_ref_rule_for_non_finite_rows():
    """NaN orders as -inf; a row with no softmax (NaN, +inf, all -inf) has NaN logprobs."""
    rows, chosen = non_finite_rows()
    lp, ids, top = logprobs.ref(rows, chosen, 3)
    np.testing.assert_array_equal(ids[[0, 1, 2, 3, 4]], [[49, 48, 47], [3, 49, 48], [48, 47, 46],
                                                         [0, 1, 2], [0, 1, 2]])
    assert np.isnan(lp[[0, 1, 3, 4]]).all() and np.isnan(top[[0, 1, 3, 4]]).all()
    assert lp[2] == -np.inf and np.isfinite(top[[2, 5]]).all() and np.isfinite(lp[5])


def test_cpu_follows_ref_on_non_finite_rows():
    """cpu once ordered a leading NaN first and gave finite logprobs to a row holding a NaN."""
    rows, chosen = non_finite_rows()
    want, got = logprobs.ref(rows, chosen, 3), logprobs.cpu(rows, chosen, 3)
    np.testing.assert_array_equal(got[1], want[1])
    for w, g in ((want[0], got[0]), (want[2], got[2])):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], rtol=1e-5, atol=1e-5)
