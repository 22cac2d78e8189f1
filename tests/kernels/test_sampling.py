"""sampling: hand-computed picks (greedy ties, inverse CDF, top-k / top-p / min-p exclusions) for
ref and cpu, and cpu vs ref on random rows, including rows that defeat cpu's sorted prefix."""
import numpy as np
import pytest

from freetoken.kernels import sampling

IMPLS = [sampling.ref, sampling.cpu]
# p = 0.25, 0.125, 0.125, 0.5 for ids 0..3: descending order is 3, 0, 1, 2 (the 0.125 tie -> id 1)
P4 = np.log(np.array([[0.25, 0.125, 0.125, 0.5]], np.float32))


def sample(impl, logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=0.5):
    B = logits.shape[0]
    col = lambda v, dt: np.full(B, v, dt)                 # noqa: E731
    out = impl(logits, col(temperature, np.float32), col(top_k, np.int32),
               col(top_p, np.float32), col(min_p, np.float32), col(u, np.float32))
    assert out.dtype == np.int32 and out.shape == (B,)
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_ties_go_to_the_lowest_id(impl):
    logits = np.array([[1.0, 3.0, 3.0, 2.0], [7.0, 7.0, 7.0, 7.0]], np.float32)
    np.testing.assert_array_equal(sample(impl, logits, temperature=0.0, u=0.99), [1, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_top_k_one_is_greedy(impl):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1      # a tie for the top
    greedy = sample(impl, logits, temperature=0.0)
    for u in (0.0, 0.5, 0.999):
        np.testing.assert_array_equal(sample(impl, logits, 1.3, top_k=1, u=u), greedy)
    assert greedy[0] == 3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("u,token", [(0.1, 3), (0.6, 0), (0.8, 1), (0.9, 2), (0.999, 2)])
def test_inverse_cdf_by_hand(impl, u, token):
    # cumulative in order 3, 0, 1, 2: 0.5, 0.75, 0.875, 1
    assert sample(impl, P4, u=u)[0] == token


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kw,kept", [
    (dict(top_k=2), [3, 0]),
    (dict(top_p=0.7), [3, 0]),             # mass before id 1 is 0.75 >= 0.7
    (dict(top_p=0.5), [3]),                # mass before id 0 is 0.5, not < 0.5
    (dict(top_p=0.8), [3, 0, 1]),
    (dict(min_p=0.3), [3, 0]),             # drops p < 0.15
    (dict(min_p=0.6), [3]),                # drops p < 0.3
    (dict(top_k=3, min_p=0.4), [3, 0]),
])
def test_filters_exclude_the_tail(impl, kw, kept):
    seen = {int(sample(impl, P4, u=u, **kw)[0]) for u in np.linspace(0, 0.999, 64)}
    assert seen == set(kept)
    # the kept tokens are renormalised: the first keeps its share of the kept mass
    p = np.array([0.5, 0.25, 0.125])[:len(kept)]
    share = p[0] / p.sum()
    assert sample(impl, P4, u=share - 0.01, **kw)[0] == kept[0]
    if len(kept) > 1:
        assert sample(impl, P4, u=share + 0.01, **kw)[0] == kept[1]


@pytest.mark.parametrize("impl", IMPLS)
def test_temperature_flattens(impl):
    # at T = 2, p ~ sqrt(0.25, 0.125, 0.125, 0.5): id 3 holds 0.7071 / 1.9142 = 0.369 (not 0.5)
    assert sample(impl, P4, temperature=2.0, u=0.36)[0] == 3
    assert sample(impl, P4, temperature=2.0, u=0.38)[0] == 0


@pytest.mark.parametrize("V", [50, 3000])
def test_cpu_matches_ref_on_random_rows(V):
    rng = np.random.default_rng(V)
    B = 48
    for scale in (0.3, 3.0, 12.0):                         # flat rows force cpu past its prefix
        logits = (rng.standard_normal((B, V)) * scale).astype(np.float32)
        logits[:, :10] = logits[:, 10:20]                  # exact ties
        args = (logits, rng.choice([0.0, 0.7, 1.0, 1.5], B).astype(np.float32),
                rng.choice([0, 1, 5, 100, V], B).astype(np.int32),
                rng.choice([0.0, 0.3, 0.9, 1.0], B).astype(np.float32),
                rng.choice([0.0, 0.02, 0.5], B).astype(np.float32),
                rng.random(B).astype(np.float32))
        np.testing.assert_array_equal(sampling.cpu(*args), sampling.ref(*args))
        out = np.empty(B, np.int32)
        assert sampling.cpu(*args, out=out) is out


# --- allowed-token mask (constrained decoding) ---

def pack(allowed):
    """bool[B, V] -> the int32[B, ceil(V/32)] bitmask (bit t & 31 of word t >> 5)."""
    B, V = allowed.shape
    padded = np.zeros((B, (V + 31) // 32 * 32), bool)
    padded[:, :V] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<i4").astype(np.int32)


def test_mask_bit_layout():
    allowed = np.zeros((1, 70), bool)
    allowed[0, [0, 31, 32, 69]] = True
    m = pack(allowed)
    assert m.shape == (1, 3) and m[0, 0] == np.int32(1 | (1 << 31) - (1 << 32)) and m[0, 1] == 1
    assert m[0, 2] == 1 << 5
    np.testing.assert_array_equal(sampling.allowed_ref(m, 70), allowed)


@pytest.mark.parametrize("impl", IMPLS)
def test_mask_restricts_greedy_and_sampling(impl):
    rng = np.random.default_rng(1)
    B, V = 6, 100
    logits = rng.standard_normal((B, V)).astype(np.float32)
    allowed = np.zeros((B, V), bool)
    allowed[:, [5, 17, 64, 99]] = True
    allowed[2] = True                                      # an unconstrained row (all -1)
    mask = pack(allowed)
    col = lambda v, dt: np.full(B, v, dt)                  # noqa: E731
    for t in (0.0, 1.0, 3.0):
        for u in np.linspace(0, 0.999, 9):
            got = impl(logits, col(t, np.float32), col(0, np.int32), col(1.0, np.float32),
                       col(0.0, np.float32), col(u, np.float32), mask=mask)
            assert all(allowed[b, got[b]] for b in range(B))
    greedy = impl(logits, col(0.0, np.float32), col(0, np.int32), col(1.0, np.float32),
                  col(0.0, np.float32), col(0.5, np.float32), mask=mask)
    masked = np.where(allowed, logits, -np.inf)
    np.testing.assert_array_equal(greedy, masked.argmax(1))


@pytest.mark.parametrize("V", [33, 4096, 40000])
def test_cpu_matches_ref_with_a_mask(V):
    rng = np.random.default_rng(V)
    B = 24
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    density = rng.choice([1.0 / V, 0.01, 0.5, 0.94, 1.0], B)
    allowed = rng.random((B, V)) < density[:, None]
    allowed[np.arange(B), rng.integers(0, V, B)] = True    # at least one allowed token per row
    mask = pack(allowed)
    params = (rng.choice([0.0, 0.7, 1.0, 2.0], B).astype(np.float32),
              rng.choice([0, 1, 5, 50], B).astype(np.int32),
              rng.choice([0.5, 0.9, 1.0], B).astype(np.float32),
              rng.choice([0.0, 0.05], B).astype(np.float32), rng.random(B).astype(np.float32))
    expect = sampling.ref(logits, *params, mask=mask)
    np.testing.assert_array_equal(sampling.cpu(logits, *params, mask=mask), expect)
    assert allowed[np.arange(B), expect].all()
    # no mask and an all-ones mask are the unmasked op
    ones = np.full_like(mask, -1)
    np.testing.assert_array_equal(sampling.cpu(logits, *params, mask=ones), sampling.cpu(logits, *params))


def non_finite_rows(V=50):
    """A NaN, a +inf, a -inf among finite logits, all -inf, all NaN, and a finite row."""
    rows = np.tile(np.linspace(-1.0, 1.0, V, dtype=np.float32), (6, 1))
    rows[0, 5], rows[1, 3], rows[2, V - 1] = np.nan, np.inf, -np.inf
    rows[3], rows[4] = -np.inf, np.nan
    return rows


def non_finite_args(temperature, V=50):
    rows = non_finite_rows(V)
    B = rows.shape[0]
    return (rows, np.full(B, temperature, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32),
            np.zeros(B, np.float32), np.full(B, 0.5, np.float32))


@pytest.mark.parametrize("impl", [sampling.ref, sampling.cpu])
def test_non_finite_rows_take_the_greedy_token_with_nan_as_minus_inf(impl):
    """The rule sampling.py writes down: greedy reads NaN as -inf; a sampled row with no softmax
    (NaN, +inf, all -inf) takes its greedy token; -inf among finite logits samples as usual."""
    greedy = impl(*non_finite_args(0.0))
    np.testing.assert_array_equal(greedy, [49, 3, 48, 0, 0, 49])
    sampled = impl(*non_finite_args(1.0))
    np.testing.assert_array_equal(sampled[[0, 1, 3, 4]], [49, 3, 0, 0])
    assert 0 <= sampled[2] < 49 and 0 <= sampled[5] < 50
    np.testing.assert_array_equal(sampled, sampling.ref(*non_finite_args(1.0)))
