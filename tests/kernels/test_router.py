"""router: ties and ordering by hand, ref against a float64 softmax, cpu vs ref (ids exact)."""
import numpy as np
import pytest

from freetoken.kernels import router
from tests.helpers import assert_close


@pytest.mark.parametrize("impl", [router.ref, router.cpu])
def test_ties_go_to_the_lower_id_and_order_is_by_weight(impl):
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0],
                       [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]], np.float32)
    ids, w = impl(logits, 4, False)
    np.testing.assert_array_equal(ids, [[1, 3, 4, 2], [0, 1, 2, 3]])
    assert ids.dtype == np.int32 and w.dtype == np.float32
    assert np.all(np.diff(w, axis=1) <= 0)
    assert_close("router uniform", np.full(4, 1 / 6), w[1], atol=1e-7, rtol=1e-6)
    ids_n, w_n = impl(logits, 4, True)
    np.testing.assert_array_equal(ids_n, ids)
    assert_close("router renormalised", w / w.sum(1, keepdims=True), w_n, atol=1e-7, rtol=1e-6)


def test_ref_matches_float64_softmax():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 64)) * 4).astype(np.float32)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(1, keepdims=True)
    ids, w = router.ref(logits, 8, False)
    np.testing.assert_array_equal(ids, np.argsort(-p, axis=1, kind="stable")[:, :8])
    assert_close("router ref vs f64", np.take_along_axis(p, ids, 1), w, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 64, 8), (33, 128, 8), (7, 60, 4)])
def test_cpu_matches_ref(T, E, k, norm):
    rng = np.random.default_rng(T * E + k)
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    logits[:, E // 2] = logits[:, 1]                      # exact ties in every row
    ids_r, w_r = router.ref(logits, k, norm)
    ids_c, w_c = router.cpu(logits, k, norm)
    np.testing.assert_array_equal(ids_c, ids_r)
    assert_close(f"router T{T} E{E} k{k}", w_r, w_c, atol=1e-7, rtol=1e-5)
    out = (np.empty((T, k), np.int32), np.empty((T, k), np.float32))
    assert router.cpu(logits, k, norm, out=out) is out
    np.testing.assert_array_equal(out[0], ids_r)


def non_finite_rows(E=12):
    """Rows a broken model can produce: a NaN, a +inf, a -inf among finite logits, all -inf, all
    NaN, and a finite row between them (its routing must not be disturbed)."""
    rows = np.tile(np.linspace(-1.0, 1.0, E, dtype=np.float32), (6, 1))
    rows[0, 5] = np.nan
    rows[1, 3] = np.inf
    rows[2, E - 1] = -np.inf
    rows[3] = -np.inf
    rows[4] = np.nan
    return rows


def test_ref_rule_for_non_finite_rows():
    """The rule router.py writes down: NaN ranks last, ties and NaNs to the lower id; a NaN or
    +inf logit or an all -inf row makes every probability NaN; -inf among finite ones is 0."""
    rows = non_finite_rows()
    ids, w = router.ref(rows, 4, True)
    for t in (0, 1, 3, 4):
        np.testing.assert_array_equal(ids[t], [0, 1, 2, 3])
        assert np.isnan(w[t]).all()
    np.testing.assert_array_equal(ids[2], [10, 9, 8, 7])      # the -inf one (11) is probability 0
    np.testing.assert_array_equal(ids[5], [11, 10, 9, 8])
    assert np.isfinite(w[[2, 5]]).all()


@pytest.mark.parametrize("norm", [True, False])
def test_cpu_follows_ref_on_non_finite_rows(norm):
    rows = non_finite_rows()
    ids_r, w_r = router.ref(rows, 4, norm)
    ids_c, w_c = router.cpu(rows, 4, norm)
    np.testing.assert_array_equal(ids_c, ids_r)
    np.testing.assert_array_equal(np.isnan(w_c), np.isnan(w_r))
    assert_close("router non-finite rows", w_r[[2, 5]], w_c[[2, 5]], atol=1e-7, rtol=1e-6)
