"""experts.gpu vs ref on the device: the decode GEMVs (T <= 16) and the sorted-by-expert GEMMs,
bf16 and f32 banks, -1 ids, duplicate ids, odd widths, real Qwen3-30B-A3B widths, and a slot pool
whose unused slot holds NaN (read once and the output is NaN: proves masking, not * 0); outputs
poisoned with NaN. Plus CPU dry runs of both paths' launches."""
import numpy as np
import pytest

from freetoken.kernels import attention, experts
from freetoken.kernels._bf16 import from_f32
from tests.helpers import assert_close
from tests.kernels.test_gpu_linear import dry_run
from freetoken.cupy_loader import cupy as load_cupy

CASES = [  # T, H, I, S, k
    (1, 64, 32, 5, 2), (3, 96, 40, 9, 4), (7, 200, 72, 9, 4), (16, 96, 33, 6, 3),      # GEMV
    (17, 64, 40, 9, 4), (70, 96, 72, 5, 3), (33, 100, 33, 9, 4), (300, 256, 128, 17, 4),  # GEMM
    (4, 2048, 768, 17, 8), (40, 2048, 768, 9, 8),                                     # real widths
    (1, 200, 768, 128, 8), (37, 200, 768, 128, 8), (300, 72, 768, 128, 8),            # E=128, k=8
]
HEAVY = {(4, 2048, 768, 17, 8), (40, 2048, 768, 9, 8), (300, 72, 768, 128, 8)}


def pool(rng, S, H, I, dtype):
    """Slot pool of S slots whose last slot is unused and full of NaN."""
    gate_up = (rng.standard_normal((S, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((S, H, I)) / np.sqrt(I)).astype(np.float32)
    gate_up[S - 1], down[S - 1] = np.nan, np.nan
    return (from_f32(gate_up), from_f32(down)) if dtype == "bf16" else (gate_up, down)


def routing(rng, T, S, k):
    """Ids over the used slots 0..S-2, a duplicate in row 0, a row with one expert, a row with
    none (-1 = runs on the CPU), and router-like weights."""
    ids = np.stack([rng.permutation(S - 1)[:k] for _ in range(T)]).astype(np.int32)
    if k > 1:
        ids[0, -1] = ids[0, 0]
    if T > 2:
        ids[T // 2, 1:] = -1
        ids[-1, :] = -1
    return ids, rng.random((T, k), dtype=np.float32)


def poison_scratch():
    """Fill the ops' shared scratch with NaN, so a kernel that reads a row it never wrote (a
    masked pair's act row, an unused attention chunk) turns the output NaN, even times 0."""
    for bufs in attention._SCRATCH.values():
        for buf in bufs:
            buf.fill(0xFF)


def _run(T, H, I, S, k, dtype, seed=0):
    cp = load_cupy()
    rng = np.random.default_rng(seed + T * H + I)
    gate_up, down = pool(rng, S, H, I, dtype)
    ids, w = routing(rng, T, S, k)
    w[ids < 0] = 0.0                                   # masked pairs: weight 0 must not matter
    x = rng.standard_normal((T, H), dtype=np.float32)
    out = cp.full((T, H), np.nan, cp.float32)
    dev = [cp.asarray(a) for a in (x, ids, w, gate_up, down)]
    experts.gpu(*dev, out)                             # sizes the scratch
    poison_scratch()
    out.fill(np.nan)
    assert experts.gpu(*dev, out) is out
    return experts.ref(x, ids, w, gate_up, down), out.get()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T,H,I,S,k", [pytest.param(*c, marks=[pytest.mark.heavy] if c in HEAVY else [])
                                       for c in CASES],
                         ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-S{c[3]}-k{c[4]}" for c in CASES])
def test_gpu_matches_ref(T, H, I, S, k, dtype):
    expect, got = _run(T, H, I, S, k, dtype)
    assert_close(f"experts gpu T{T} H{H} I{I} {dtype}", expect, got, 1e-4, 1e-3)
    if T > 2:
        np.testing.assert_array_equal(got[-1], 0.0)      # all -1: overwritten with zeros


@pytest.mark.gpu
def test_gpu_many_tiles_per_expert_and_strided_blocks(monkeypatch):
    """Groups spanning several 64-row tiles, with one GEMM block looping over every tile."""
    monkeypatch.setattr(experts, "MAX_TILE_BLOCKS", 1)
    expect, got = _run(200, 96, 40, 4, 2, "bf16", seed=3)
    assert_close("experts gpu strided tiles", expect, got, 1e-4, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 40])
def test_gpu_all_ids_negative_gives_zeros(T):
    cp = load_cupy()
    rng = np.random.default_rng(T)
    gate_up, down = (cp.asarray(a) for a in pool(rng, 3, 64, 32, "bf16"))
    out = cp.full((T, 64), np.nan, cp.float32)
    experts.gpu(cp.asarray(rng.standard_normal((T, 64), dtype=np.float32)),
                cp.full((T, 4), -1, cp.int32), cp.ones((T, 4), cp.float32), gate_up, down, out)
    np.testing.assert_array_equal(out.get(), 0.0)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T", [3, 40])
def test_dry_run_binds_args(T, dtype, monkeypatch):
    rng = np.random.default_rng(0)
    gate_up, down = pool(rng, 5, 64, 40, dtype)
    ids, w = routing(rng, T, 5, 3)
    x, out = rng.standard_normal((T, 64), dtype=np.float32), np.empty((T, 64), np.float32)
    entries = dry_run(monkeypatch, experts, experts.gpu, x, ids, w, gate_up, down, out)
    want = ([f"experts_gate_up_{dtype}", f"experts_down_{dtype}"] if T <= experts.GEMV_MAX_T else
            ["experts_plan_i32", f"experts_gemm_gate_up_{dtype}", f"experts_gemm_down_{dtype}",
             "experts_combine_f32"])
    assert entries == want


def test_scratch_bytes_cover_the_layout():
    for T in (1, 16, 17, 8192):
        need = sum(4 * n for _, _, n in experts._layout(T, 8, 2048, 768, 128))
        assert need <= experts.scratch_bytes(T, 8, 2048, 768, 128) < need + 256 * 8
