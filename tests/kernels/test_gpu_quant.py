"""The CUDA kernels over quantized weights (cuda/qblocks.cuh and the modules built per format:
qblocks.cu, linear_quant.cu, experts_quant.cu) against the spec: row dequantization bit for bit
(the embedding gather of a quantized table, every format), the linear GEMV and GEMM (every format,
a weight in parts of two formats), and the experts' decode GEMVs and prefill GEMMs (mixed gate_up /
down formats, -1 ids, slot views a stride apart as the runtime's shared byte pool gives them).
Outputs are poisoned with NaN first."""
import numpy as np
import pytest

from freetoken.kernels import embedding, experts, linear
from freetoken.kernels.qformats import FORMATS, dequantize_ref, random_blocks
from freetoken.moe.pool import Bank, slot_pool, slot_views
from tests.helpers import assert_close
from tests.kernels.test_experts_quant import routing
from tests.kernels.test_gpu_experts import poison_scratch
from tests.kernels.test_gpu_linear import dry_run
from freetoken.cupy_loader import cupy as load_cupy

NAMES = [f.name for f in FORMATS]


def close(name, ref, out):
    """Within fp32 summation error: random blocks give outputs of a few hundred, some of which
    cancel to near zero, so the absolute tolerance scales with the largest output."""
    assert_close(name, ref, out, 2e-5 * float(np.abs(ref).max()) + 1e-5, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_rows_bit_exact(name):
    """Every value of every row as gguf-py (or the FP8 rule) computes it, bit for bit; an id
    outside the table gives a NaN row, as the dense embedding kernel does."""
    cp = load_cupy()
    rng = np.random.default_rng(7)
    table = random_blocks(name, (9,), 1024, rng)
    ids = np.array([3, 0, 8, 3, -1, 9, 5], np.int32)
    out = cp.full((len(ids), 1024), 7.0, cp.float32)
    embedding.gpu(cp.asarray(ids), cp.asarray(table), out)
    got, want = out.get(), dequantize_ref(table)
    ok = ids >= 0
    ok &= ids < 9
    assert np.array_equal(got[ok].view(np.uint32), want[ids[ok]].view(np.uint32)), name
    assert np.isnan(got[~ok]).all()


@pytest.mark.gpu
def test_mxfp4_rows_bit_exact_for_every_exponent_and_code():
    """cuda/qblocks.cuh's mxfp4 loads over all 256 e8m0 exponents (subnormal scales at 0 and 1,
    infinities from 12 * 2**127) with every code, as gguf-py dequantizes them (the numba rows:
    tests/kernels/test_qblocks.py)."""
    cp = load_cupy()
    table = np.zeros((16, 16, 17), np.uint8)                              # 16 rows of 512 values
    table[..., 0] = np.arange(256).reshape(16, 16)
    table[..., 1:] = np.arange(16, dtype=np.uint8) * 17                  # codes c in both nibbles
    out = cp.full((16, 512), 7.0, cp.float32)
    embedding.gpu(cp.asarray(np.arange(16, dtype=np.int32)), cp.asarray(table), out)
    with np.errstate(over="ignore"):
        want = dequantize_ref(table)
    assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 70])
@pytest.mark.parametrize("name", NAMES)
def test_linear_matches_ref(name, T):
    cp = load_cupy()
    rng = np.random.default_rng(T)
    w = random_blocks(name, (37,), 512, rng)
    x = rng.standard_normal((T, 512), dtype=np.float32)
    out = cp.full((T, 37), np.nan, cp.float32)
    linear.gpu(cp.asarray(x), cp.asarray(w), out)
    close(f"linear gpu {name} T{T}", linear.ref(x, w), out.get())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "fp8_b128", "mxfp4"])
def test_linear_long_rows_and_unaligned_x(name):
    """K = 2048 takes the GEMV's unrolled loop more than once; an x 4 bytes off 16-byte alignment
    takes the quantized rows' scalar path."""
    cp = load_cupy()
    rng = np.random.default_rng(9)
    w = random_blocks(name, (12,), 2048, rng)
    for T in (1, 3):
        x = rng.standard_normal((T, 2048), dtype=np.float32)
        buf = cp.empty(T * 2048 + 1, cp.float32)
        dx = buf[1:].reshape(T, 2048)                     # contiguous, 4 bytes off
        dx[...] = cp.asarray(x)
        for arg in (cp.asarray(x), dx):
            out = cp.full((T, 12), np.nan, cp.float32)
            linear.gpu(arg, cp.asarray(w), out)
            close(f"linear gpu {name} K2048 T{T}", linear.ref(x, w), out.get())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 40])
def test_linear_in_parts(T):
    """q/k/v of two formats (Q4_K_M's attn_v in Q6_K): each part writes its columns of out."""
    cp = load_cupy()
    rng = np.random.default_rng(3)
    parts = (random_blocks("q4_k", (40,), 256, rng), random_blocks("q6_k", (24,), 256, rng),
             random_blocks("q4_k", (8,), 256, rng))
    x = rng.standard_normal((T, 256), dtype=np.float32)
    out = cp.full((T, 72), np.nan, cp.float32)
    linear.gpu(cp.asarray(x), tuple(cp.asarray(p) for p in parts), out)
    close(f"linear gpu parts T{T}", linear.ref(x, parts), out.get())


def _experts_case(gu, dn, T, k=3, E=6, H=256, I=256, seed=0):
    rng = np.random.default_rng(seed + T)
    gate_up, down = random_blocks(gu, (E, 2 * I), H, rng), random_blocks(dn, (E, H), I, rng)
    ids, w = routing(rng, T, E, k)
    x = rng.standard_normal((T, H), dtype=np.float32) * np.float32(0.5)
    return x, ids, w, gate_up, down


PAIRS = [("q8_0", "q8_0"), ("q4_k", "q6_k"), ("q5_k", "q5_k"), ("fp8_b128", "fp8_b128"),
         ("q2_k", "q3_k"), ("q4_0", "q5_1"), ("q4_1", "q5_0"), ("mxfp4", "mxfp4")]     # mxfp4: gpt-oss


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 40])
@pytest.mark.parametrize("gu,dn", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_experts_match_ref(gu, dn, T):
    cp = load_cupy()
    x, ids, w, gate_up, down = _experts_case(gu, dn, T)
    poison_scratch()
    out = cp.full(x.shape, np.nan, cp.float32)
    experts.gpu(*(cp.asarray(a) for a in (x, ids, w, gate_up, down)), out)
    close(f"experts gpu {gu}/{dn} T{T}", experts.ref(x, ids, w, gate_up, down), out.get())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 40])
def test_experts_on_strided_slots(T):
    """A layer whose experts are smaller than the pool's slots (a q4_k layer in a pool sized for
    q6_k): the kernels read each slot's first bytes, a slot stride apart."""
    cp = load_cupy()
    x, ids, w, gate_up, down = _experts_case("q4_k", "q4_k", T, E=5)
    big = Bank(random_blocks("q6_k", (5, 512), 256, np.random.default_rng(1)),
               random_blocks("q6_k", (5, 256), 256, np.random.default_rng(2)))
    pool = slot_pool(cp, 5, [Bank(gate_up, down), big])
    gu_view, dn_view = slot_views(pool, Bank(gate_up, down))
    assert not gu_view.flags.c_contiguous
    gu_view[...] = cp.asarray(gate_up)
    dn_view[...] = cp.asarray(down)
    out = cp.full(x.shape, np.nan, cp.float32)
    experts.gpu(cp.asarray(x), cp.asarray(ids), cp.asarray(w), gu_view, dn_view, out)
    close(f"experts gpu strided T{T}", experts.ref(x, ids, w, gate_up, down), out.get())


@pytest.mark.parametrize("T", [1, 40])
def test_dry_run_launches(monkeypatch, T):
    """Without a device: the quantized launches bind the *_q entries' arguments in order, each
    bank through its own format's module."""
    x, ids, w, gate_up, down = _experts_case("q4_k", "q6_k", T)
    monkeypatch.setattr(experts, "_carve", lambda like, layout: {
        n: np.zeros(c, d) for n, d, c in layout})
    monkeypatch.setattr("freetoken.kernels._cuda.flat_span", lambda a: a.reshape(-1))
    names = dry_run(monkeypatch, experts, experts.gpu, x, ids, w, gate_up, down,
                    np.empty(x.shape, np.float32))
    q = "" if T == 1 else "gemm_"
    assert f"experts_{q}gate_up_q" in names and f"experts_{q}down_q" in names, names
