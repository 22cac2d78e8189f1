"""kernels/_peak.py: the measured compute peak each ``kernel --bench`` share is taken of. The chains
really run the instruction n times (their sums are exact), and the peak is a rate."""
import numpy as np
import pytest

from freetoken.kernels import _peak


def _kinds():
    from freetoken.kernels._isa import bf16_dots
    return ["fp32", "int8"] + (["bf16"] if bf16_dots() else [])


@pytest.mark.parametrize("kind", _kinds())
def test_every_thread_runs_each_chain_n_times(kind):
    """Lane 0 of each of the CHAINS accumulators after n calls, summed: int8 4 * 3 * 5 a call, fp32
    2**-20, bf16 two products of 2**-14; all exact in the accumulators' types."""
    a, b = _peak.operands(kind)
    out = np.zeros(3)
    n = 1000
    _peak._runner(kind)(a, b, n, out)
    per_call = {"int8": 60.0, "fp32": 2.0 ** -20, "bf16": 2.0 ** -13}[kind]
    np.testing.assert_array_equal(out, _peak.CHAINS * n * per_call)


@pytest.mark.parametrize("kind", _kinds())
def test_the_peak_is_a_rate_of_operations(kind):
    rate = _peak.measure_peak(kind, steps=20_000, repeats=2)
    assert 1e8 < rate < 1e15                           # between a slow core and far beyond any CPU
    assert _peak.what_runs(kind)
