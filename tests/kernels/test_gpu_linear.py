"""linear.gpu vs ref on the device at awkward sizes: both kernels (GEMV for T <= 8, tiled GEMM
above), bf16 and f32 weights, misaligned views (scalar path), an lm_head-sized M; outputs poisoned
with NaN. Plus a CPU dry run of the wrapper's launches (argument types against ARGS)."""
import numpy as np
import pytest

from freetoken.kernels import _cuda, linear
from freetoken.kernels._bf16 import from_f32
from tests.helpers import assert_close
from freetoken.cupy_loader import cupy as load_cupy

CASES = [(1, 64, 5), (3, 40, 7), (8, 256, 9), (5, 33, 3), (9, 72, 70), (67, 100, 130),
         (2, 2048, 4096), (130, 2048, 768), (4, 2048, 32000), (1, 4096, 2048),
         (1, 64, 151936), (37, 40, 151936)]                     # lm_head of a 151936 vocab
HEAVY = {(4, 2048, 32000), (37, 40, 151936)}


def dry_run(monkeypatch, module, fn, *args):
    """Call a gpu wrapper on numpy arrays with launches recorded instead of made; check every
    launch's arguments against the module's ARGS and its geometry. Returns the entry names."""
    launches = []
    monkeypatch.setattr(_cuda, "kernel", lambda name, entry, defines=(): (name, entry))
    monkeypatch.setattr(_cuda, "launch", lambda k, grid, block, a, shared_mem=0:
                        launches.append((k[1], tuple(grid), tuple(block), a, shared_mem)))
    fn(*args)
    for entry, grid, block, a, shared_mem in launches:
        decl = module.ARGS[entry]
        assert len(a) == len(decl), (entry, len(a), decl)
        for item, v in zip(decl, a):
            tag = item.partition(":")[2]
            want = _cuda.POINTER_DTYPES.get(tag) or _cuda.SCALAR_TYPES[tag]
            assert (v.dtype if tag.endswith("*") else type(v)) == want, (entry, item, type(v))
        assert all(g >= 0 for g in grid) and block[0] % 32 == 0 and block[0] <= 1024, (entry, grid)
        assert len(grid) <= 1 or max(grid[1:]) < 65536, (entry, grid)
        assert shared_mem <= 48 * 1024, (entry, shared_mem)
    return [launch[0] for launch in launches]


def _inputs(T, K, M, dtype, seed=0):
    rng = np.random.default_rng(seed + T * K + M)
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = rng.standard_normal((M, K), dtype=np.float32) * np.float32(K ** -0.5)
    return x, (from_f32(w) if dtype == "bf16" else w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T,K,M", [pytest.param(*c, marks=[pytest.mark.heavy] if c in HEAVY else [])
                                   for c in CASES], ids=[f"T{t}-K{k}-M{m}" for t, k, m in CASES])
def test_gpu_matches_ref(T, K, M, dtype):
    cp = load_cupy()
    x, w = _inputs(T, K, M, dtype)
    out = cp.full((T, M), np.nan, cp.float32)
    assert linear.gpu(cp.asarray(x), cp.asarray(w), out) is out
    assert_close(f"linear gpu T{T} K{K} M{M} {dtype}", linear.ref(x, w), out.get(), 1e-4, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 70])
def test_gpu_misaligned_views(T):
    """Views starting one element into an allocation: 16-byte loads would fault, so the kernels
    must notice and take the scalar path."""
    cp = load_cupy()
    x, w = _inputs(T, 64, 40, "bf16", seed=1)
    xs = cp.empty(T * 64 + 1, cp.float32)[1:].reshape(T, 64)
    ws = cp.empty(40 * 64 + 1, cp.uint16)[1:].reshape(40, 64)
    xs[...], ws[...] = cp.asarray(x), cp.asarray(w)
    out = cp.full((T, 40), np.nan, cp.float32)
    linear.gpu(xs, ws, out)
    assert_close(f"linear gpu misaligned T{T}", linear.ref(x, w), out.get(), 1e-4, 1e-4)


@pytest.mark.gpu
def test_gpu_zero_tokens_launch_nothing():
    cp = load_cupy()
    out = cp.empty((0, 8), cp.float32)
    assert linear.gpu(cp.empty((0, 16), cp.float32), cp.ones((8, 16), cp.uint16), out) is out


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T,algo", [(1, "gemv"), (8, "gemv"), (9, "gemm"), (130, "gemm")])
def test_dry_run_picks_kernel_and_binds_args(T, algo, dtype, monkeypatch):
    x, w = _inputs(T, 40, 7, dtype)
    entries = dry_run(monkeypatch, linear, linear.gpu, x, w, np.empty((T, 7), np.float32))
    assert entries == [f"linear_{algo}_{dtype}"]
