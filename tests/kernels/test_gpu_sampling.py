"""sampling.gpu vs ref on the device. The kernel sums probability mass in a different order than
ref's cumsums, so a uniform (or top_p / min_p) within ~1e-5 of a step of the CDF may pick the
neighbouring token: a mismatch is accepted only when ref itself picks that token after nudging
u, top_p and min_p by that much, or the two tokens' probabilities agree to 1e-5 (an ulp of exp
can swap them in the order). Outputs are poisoned (-7) before the launch."""
import itertools

import numpy as np
import pytest

from freetoken.kernels import sampling
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu
NUDGE = 2e-5


def _accepted(z, t, k, p, mp, u):
    """Tokens ref picks with u, top_p, min_p each nudged by -NUDGE, 0, +NUDGE."""
    picks = set()
    for du, dp, dm in itertools.product((-NUDGE, 0.0, NUDGE), repeat=3):
        uu = np.float32(min(max(u + du, 0.0), 0.99999994))
        pp = np.float32(p + dp) if 0 < p < 1 else p
        mm = np.float32(mp + dm) if mp > 0 else mp
        picks.add(sampling._ref_row(z, t, k, pp, mm, uu))
    if t > 0:   # expf differs from numpy's exp by an ulp or two: near-equal tokens may swap
        p = sampling._probs(z, t)
        for tok in list(picks):
            picks.update(np.flatnonzero(np.abs(p - p[tok]) <= 1e-5 * p[tok]).tolist())
    return picks


def _check(logits, temperature, top_k, top_p, min_p, uniforms):
    cp = load_cupy()
    B = logits.shape[0]
    params = [np.asarray(a, dt) for a, dt in ((temperature, np.float32), (top_k, np.int32),
                                             (top_p, np.float32), (min_p, np.float32),
                                             (uniforms, np.float32))]
    out = cp.full(B, -7, cp.int32)
    assert sampling.gpu(cp.asarray(logits), *[cp.asarray(a) for a in params], out) is out
    got, expect = out.get(), sampling.ref(logits, *params)
    for b in np.flatnonzero(got != expect):
        row = [a[b] for a in params]
        assert got[b] in _accepted(logits[b], *row), (b, got[b], expect[b], row)


def _params(rng, B):
    temperature = rng.choice([0.0, 0.3, 0.8, 1.0, 2.5], B)
    top_k = rng.choice([0, 1, 2, 20, 50, 10 ** 6], B)
    top_p = rng.choice([0.0, 0.05, 0.5, 0.9, 0.95, 1.0], B)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.1, 0.5], B)
    return temperature, top_k, top_p, min_p, rng.random(B)


@pytest.mark.parametrize("B,V", [(1, 1), (3, 5), (7, 33), (17, 1000), (64, 4099), (4, 151936)])
def test_gpu_matches_ref(B, V):
    rng = np.random.default_rng(B * V)
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    _check(logits, *_params(rng, B))


@pytest.mark.parametrize("V", [7, 300, 5000])
def test_gpu_ties_and_plateaus(V):
    """Integer logits: many exact ties in probability, which go to the lower id everywhere."""
    rng = np.random.default_rng(V)
    B = 40
    logits = rng.integers(-4, 3, (B, V)).astype(np.float32)
    _check(logits, *_params(rng, B))


def test_gpu_every_filter_combination():
    rng = np.random.default_rng(3)
    combos = list(itertools.product([0, 1, 7, 100], [0.0, 0.3, 0.99], [0.0, 0.2]))
    B, V = len(combos), 2000
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    top_k, top_p, min_p = (np.array(c) for c in zip(*combos))
    _check(logits, np.full(B, 0.9), top_k, top_p, min_p, rng.random(B))


def test_gpu_uniform_extremes_and_underflow():
    """u = 0 and u just below 1, and a row whose tail underflows to probability 0."""
    V = 3000
    logits = np.zeros((4, V), np.float32)
    logits[:, :10] = 200.0                      # e = exp(-200) underflows for the rest at T = 1
    u = np.array([0.0, 0.99999994, 0.5, 0.99999994], np.float32)
    _check(logits, np.ones(4), np.zeros(4), np.ones(4), np.zeros(4), u)


def test_gpu_with_a_mask():
    """Masked rows (and unconstrained all -1 rows beside them) against ref with the same mask."""
    from tests.kernels.test_sampling import pack
    cp = load_cupy()
    rng = np.random.default_rng(11)
    B, V = 12, 4099
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    density = rng.choice([1.0 / V, 0.01, 0.5, 1.0], B)
    allowed = rng.random((B, V)) < density[:, None]
    allowed[np.arange(B), rng.integers(0, V, B)] = True
    mask = pack(allowed)
    params = [np.asarray(a, dt) for a, dt in zip(_params(rng, B), (np.float32, np.int32, np.float32,
                                                                   np.float32, np.float32))]
    out = cp.full(B, -7, cp.int32)
    dev_logits = cp.asarray(logits)
    sampling.gpu(dev_logits, *[cp.asarray(a) for a in params], out, mask=cp.asarray(mask))
    got = out.get()
    np.testing.assert_array_equal(dev_logits.get(), logits)          # the caller's logits untouched
    assert allowed[np.arange(B), got].all()
    expect = sampling.ref(logits, *params, mask=mask)
    masked = np.where(allowed, logits, -np.inf).astype(np.float32)
    for b in np.flatnonzero(got != expect):
        assert got[b] in _accepted(masked[b], *[a[b] for a in params]), (b, got[b], expect[b])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_follows_ref_on_non_finite_rows(temperature):
    """Ids in [0, V) and ref's: a sampled NaN / +inf / all -inf row once came back as token V."""
    from tests.kernels.test_sampling import non_finite_args
    cp = load_cupy()
    args = non_finite_args(temperature)
    out = cp.full(args[0].shape[0], -7, cp.int32)
    got = sampling.gpu(*[cp.asarray(a) for a in args], out).get()
    np.testing.assert_array_equal(got, sampling.ref(*args))
