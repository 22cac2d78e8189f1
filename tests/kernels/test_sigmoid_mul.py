"""sigmoid_mul: ref against float64, cpu vs ref with a full [R,D] gate and a per-row [R,1] gate,
in place, extreme gates."""
import numpy as np
import pytest

from freetoken.kernels import sigmoid_mul
from tests.helpers import assert_close

SHAPES = [(1, 1), (3, 50), (4, 4096), (4, 2048), (37, 129), (65, 4096)]  # the last: parallel


def gate_args(rng, R, D, full):
    x = (rng.standard_normal((R, D)) * 2).astype(np.float32)
    gate = (rng.standard_normal((R, D) if full else (R, 1)) * 6).astype(np.float32)
    return x, gate


@pytest.mark.parametrize("full", [True, False], ids=["full", "row"])
def test_ref_matches_float64(full):
    x, gate = gate_args(np.random.default_rng(2), 5, 64, full)
    expect = x.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64)))
    assert_close("sigmoid_mul ref vs f64", expect, sigmoid_mul.ref(x, gate), 1e-7, 1e-6)


@pytest.mark.parametrize("full", [True, False], ids=["full", "row"])
@pytest.mark.parametrize("R,D", SHAPES)
def test_cpu_matches_ref(R, D, full):
    x, gate = gate_args(np.random.default_rng(R * D), R, D, full)
    expect = sigmoid_mul.ref(x, gate)
    assert_close(f"sigmoid_mul R{R} D{D}", expect, sigmoid_mul.cpu(x, gate), 1e-6, 1e-5)
    inplace = x.copy()
    assert sigmoid_mul.cpu(inplace, gate, out=inplace) is inplace
    assert_close("in place", expect, inplace, 1e-6, 1e-5)


def test_extreme_gates():
    x = np.full((1, 8), 3.0, np.float32)
    gate = np.array([[-200, -90, -20, 0, 20, 90, 200, 1]], np.float32)
    got = sigmoid_mul.cpu(x, gate)
    assert np.isfinite(got).all()
    assert_close("extreme gates", sigmoid_mul.ref(x, gate), got, 1e-7, 1e-6)


def test_wrong_gate_shape_is_refused():
    with pytest.raises(AssertionError):
        sigmoid_mul.cpu(np.zeros((3, 4), np.float32), np.zeros((3, 2), np.float32))
