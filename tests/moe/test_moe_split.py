"""The q* split (docs/design.md, The q* split): integer rule, its properties, and FetchPolicy."""
import numpy as np
import pytest

from freetoken.moe.split import Q16, FetchPolicy, fetch_count, frac_q16

PHIS = [i / 97 for i in range(0, 98)] + [0.415, 0.5, 0.682, 1e-6, 0.999999, 1.0, 1.5, 10.0]
TABLE1 = [(52.7, 77.3, 3), (25.1, 63.2, 1), (25.3, 56.7, 2), (49.0, 53.8, 4), (11.8, 47.5, 1),
          (51.5, 178.0, 1)]


def brute_force(m: int, frac: int) -> int:
    """Integer argmin over f in [0, m] of max(f*(1-phi), (m-f)*phi) in Q16; ties -> fewer."""
    costs = [max(f * (Q16 - frac), (m - f) * frac) for f in range(m + 1)]
    return costs.index(min(costs))


def test_frac_q16_rounds_and_clamps():
    assert frac_q16(0.0) == 0 and frac_q16(-3.0) == 0
    assert frac_q16(1.0) == Q16 and frac_q16(7.5) == Q16 and frac_q16(float("inf")) == Q16
    assert frac_q16(0.5) == 32768
    assert frac_q16(0.5 / Q16) == 0            # Python round: half to even
    assert frac_q16(1.5 / Q16) == 2
    with pytest.raises(ValueError):
        frac_q16(float("nan"))


@pytest.mark.parametrize("phi", PHIS)
def test_close_to_m_phi_and_is_the_makespan_argmin(phi):
    frac = frac_q16(phi)
    for m in range(0, 65):
        q = fetch_count(m, frac)
        assert 0 <= q <= m
        assert abs(q - m * min(phi, 1.0)) <= 1 + 1e-9 * m
        assert q == brute_force(m, frac)


def test_edges_and_worked_examples():
    for m in range(0, 65):
        assert fetch_count(m, frac_q16(1.0)) == m
        assert fetch_count(m, frac_q16(3.0)) == m
        assert fetch_count(m, frac_q16(0.0)) == 0
    assert fetch_count(3, frac_q16(0.415)) == 1       # not the ceil (2)
    assert fetch_count(4, frac_q16(0.415)) == 2


@pytest.mark.parametrize("b_p, b_h, want", TABLE1)
def test_reference_machines(b_p, b_h, want):   # docs/design.md, The q* split
    assert fetch_count(4, frac_q16(b_p / b_h)) == want


def test_q_for_m_1_to_12():
    rows = {0.10: "0 0 0 0 0 0 0 0 1 1 1 1", 0.25: "0 0 0 1 1 1 1 2 2 2 2 3",
            0.40: "0 1 1 1 2 2 3 3 3 4 4 5", 0.50: "0 1 1 2 2 3 3 4 4 5 5 6",
            0.682: "1 2 2 3 4 4 5 6 6 7 8 8"}
    for phi, row in rows.items():
        assert [fetch_count(m, frac_q16(phi)) for m in range(1, 13)] == [int(v) for v in row.split()]


def test_fetch_count_rejects_bad_input():
    with pytest.raises(ValueError):
        fetch_count(-1, 100)
    with pytest.raises(ValueError):
        fetch_count(3, Q16 + 1)


def test_policies():
    frac0 = FetchPolicy.fraction(0.0)
    assert frac0.kind == "fraction" and [frac0.count(m) for m in range(5)] == [0] * 5
    assert [FetchPolicy.fraction(0.0, min_fill=1).count(m) for m in range(4)] == [0, 1, 1, 1]
    assert [FetchPolicy.fixed_cap(2).count(m) for m in range(5)] == [0, 1, 2, 2, 2]
    assert [FetchPolicy.fixed_cap(0, min_fill=1).count(m) for m in range(3)] == [0, 1, 1]
    assert [FetchPolicy.fetch_all().count(m) for m in range(5)] == list(range(5))
    assert FetchPolicy.fraction(0.3).count(10) == fetch_count(10, frac_q16(0.3))
    # min-fill never lowers q and only changes q = 0 with m > 0
    for phi in np.linspace(0, 1, 41):
        for m in range(1, 20):
            a, b = FetchPolicy.fraction(phi).count(m), FetchPolicy.fraction(phi, 1).count(m)
            assert b == max(a, 1)


def test_policy_validation():
    for bad in [dict(kind="none"), dict(kind="cap", cap=-1), dict(kind="fraction", frac_q16=-1),
                dict(kind="fraction", frac_q16=Q16 + 1), dict(kind="all", min_fill=2)]:
        with pytest.raises(ValueError):
            FetchPolicy(**bad)
