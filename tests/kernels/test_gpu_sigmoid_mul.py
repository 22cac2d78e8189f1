"""sigmoid_mul.gpu vs ref on the device, a full gate and a per-row gate, in place; outputs
poisoned with NaN."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import sigmoid_mul
from tests.helpers import assert_close, assert_launches
from tests.kernels.test_sigmoid_mul import gate_args

pytestmark = pytest.mark.gpu
SHAPES = [(1, 1), (3, 50), (5, 257), (37, 129), (4, 4096), (4, 2048)]


@pytest.mark.parametrize("full", [True, False], ids=["full", "row"])
@pytest.mark.parametrize("R,D", SHAPES)
def test_gpu_matches_ref(R, D, full):
    cp = load_cupy()
    x, gate = gate_args(np.random.default_rng(R * D + full), R, D, full)
    out = cp.full((R, D), np.nan, cp.float32)
    assert sigmoid_mul.gpu(cp.asarray(x), cp.asarray(gate), out) is out
    assert_close(f"sigmoid_mul gpu R{R} D{D}", sigmoid_mul.ref(x, gate), out.get(), 1e-6, 1e-5)


@pytest.mark.parametrize("full", [True, False], ids=["full", "row"])
def test_gpu_in_place(full):
    cp = load_cupy()
    x, gate = gate_args(np.random.default_rng(8), 6, 300, full)
    dx = cp.asarray(x)
    sigmoid_mul.gpu(dx, cp.asarray(gate), dx)
    assert_close("sigmoid_mul gpu in place", sigmoid_mul.ref(x, gate), dx.get(), 1e-6, 1e-5)


def test_gpu_extreme_gates():
    cp = load_cupy()
    x = np.full((1, 8), 3.0, np.float32)
    gate = np.array([[-200, -90, -20, 0, 20, 90, 200, 1]], np.float32)
    out = cp.full((1, 8), np.nan, cp.float32)
    sigmoid_mul.gpu(cp.asarray(x), cp.asarray(gate), out)
    assert_close("extreme gates", sigmoid_mul.ref(x, gate), out.get(), 1e-7, 1e-6)


def test_gpu_zero_rows_launch_nothing():
    """No rows: no kernel (CUDA rejects a zero grid); one row: one, so the count sees a launch."""
    cp = load_cupy()
    for rows, launched in ((0, 0), (1, 1)):
        x, gate = cp.ones((rows, 64), cp.float32), cp.ones((rows, 1), cp.float32)
        out = cp.empty((rows, 64), cp.float32)
        assert_launches(lambda: sigmoid_mul.gpu(x, gate, out), launched)
    assert_close("sigmoid_mul gpu one row", sigmoid_mul.ref(x.get(), gate.get()), out.get(),
                 1e-6, 1e-5)


@pytest.mark.heavy
@pytest.mark.parametrize("D,full", [(4096, True), (2048, False)],
                         ids=["attn-gate", "shared-expert"])
def test_gpu_qwen36_prefill(D, full):
    cp = load_cupy()
    x, gate = gate_args(np.random.default_rng(D), 256, D, full)
    out = cp.full((256, D), np.nan, cp.float32)
    sigmoid_mul.gpu(cp.asarray(x), cp.asarray(gate), out)
    assert_close("sigmoid_mul qwen3.6", sigmoid_mul.ref(x, gate), out.get(), 1e-6, 1e-5)
