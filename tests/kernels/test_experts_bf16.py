"""bf16 experts with their activations rounded to bf16 (bf16=True: the cpu backend under --cpu-dots
int8, the default): every path of experts.cpu against experts.ref's spec (x and the SwiGLU output
rounded to bf16), the vdpbf16ps tile GEMM where the CPU has AVX512-BF16 (kernels/experts_bf16.py),
and bf16=False left exact."""
import numpy as np
import pytest

from freetoken.kernels import _isa, _simd, experts, experts_bf16
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close
from tests.kernels.test_experts import banks, routing



def assert_spec(name, want, got, exact):
    """got is want within fp32 reordering, except where a SwiGLU output computed in another fp32
    order sat on the other side of a bf16 rounding boundary and rounded one bf16 step the other
    way (rare: a step is 2^-8 of the value, an fp32 reorder ~2^-23), moving its token's outputs by
    up to a step times a down row; and on the whole far closer to want than to exact (the same
    inputs without the rounding): a path that skipped a rounding fails that."""
    assert_close(name, want, got, atol=2.0 ** -8 * np.abs(want).max(), rtol=1e-4)
    assert np.abs(got - want).mean() < 0.25 * np.abs(got - exact).mean(), name
needs_bf16 = pytest.mark.skipif(not _isa.bf16_dots(), reason="this CPU has no AVX512-BF16")


def _case(T, H, I, seed, S=9, k=4):
    rng = np.random.default_rng(seed)
    gate_up, down = banks(rng, S, H, I, np.uint16)
    ids, w = routing(rng, T, S, k)
    return rng.standard_normal((T, H)).astype(np.float32), ids, w, gate_up, down


def test_the_spec_rounds_x_and_the_activation_to_bf16():
    x, ids, w, gate_up, down = _case(3, 96, 40, 0)
    fast = experts.ref(x, ids, w, gate_up, down, bf16=True)
    rounded_x = to_f32(from_f32(x))
    assert not np.array_equal(rounded_x, x)
    exact_on_rounded_x = experts.ref(rounded_x, ids, w, gate_up, down, bf16=False)
    assert_close("spec", exact_on_rounded_x, fast, atol=2e-2, rtol=2e-2)   # only the activation's rounding apart
    assert not np.array_equal(fast, experts.ref(x, ids, w, gate_up, down, bf16=False))


@pytest.mark.parametrize("path", ["gemv", "tiles_or_blas", "blas"])
@pytest.mark.parametrize("T,H,I", [(7, 96, 40), (37, 128, 64), (70, 64, 96), (5, 70, 48), (3, 66, 40)])
def test_every_path_matches_the_spec(T, H, I, path, monkeypatch):
    """gemv: few tokens an expert; tiles_or_blas: many (the tiles where the CPU has them); blas:
    many, with the tiles unavailable (a CPU without AVX512-BF16). H 96 and I 40 leave words after
    the decode dots' last full vector step; H 70 and 66 end in a short block of down rows (6 and 2
    rows: the four streams' rows past the block read the last row again)."""
    monkeypatch.setattr(experts, "BLAS_MIN_PAIRS", 1 << 30 if path == "gemv" else 0)
    if path == "blas":
        monkeypatch.setattr(_isa, "bf16_dots", lambda features=None: False)
    x, ids, w, gate_up, down = _case(T, H, I, T * H + I)
    expect = experts.ref(x, ids, w, gate_up, down, bf16=True)
    out = np.full((T, H), np.nan, np.float32)
    assert experts.cpu(x, ids, w, gate_up, down, out=out, bf16=True) is out
    assert_spec(f"bf16 experts {path} T{T}", expect, out, experts.ref(x, ids, w, gate_up, down, bf16=False))
    np.testing.assert_array_equal(out[-1], 0.0)                # the row routed to no expert


def test_without_bf16_the_experts_stay_exact(monkeypatch):
    monkeypatch.setattr(experts, "BLAS_MIN_PAIRS", 0)
    x, ids, w, gate_up, down = _case(33, 96, 40, 5)
    assert_close("f32", experts.ref(x, ids, w, gate_up, down, bf16=False),
                 experts.cpu(x, ids, w, gate_up, down, bf16=False), atol=1e-5, rtol=1e-4)


@needs_bf16
def test_the_tiles_run_and_agree_with_the_spec(monkeypatch):
    calls = []
    gemm = experts_bf16.gemm
    monkeypatch.setattr(experts_bf16, "gemm", lambda *a: calls.append(1) or gemm(*a))
    x, ids, w, gate_up, down = _case(200, 256, 128, 7, S=16, k=4)   # ~50 tokens an expert
    out = experts.cpu(x, ids, w, gate_up, down, bf16=True)
    assert calls == [1]
    assert_spec("tiles", experts.ref(x, ids, w, gate_up, down, bf16=True), out,
                experts.ref(x, ids, w, gate_up, down, bf16=False))


@needs_bf16
def test_one_expert_for_every_token_packs_and_agrees(monkeypatch):
    """A dense SwiGLU layer (one "expert", weight 1, every token): 75 tokens, five tiles and a
    padding one, packed a tile a work item."""
    calls = []
    gemm = experts_bf16.gemm
    monkeypatch.setattr(experts_bf16, "gemm", lambda *a: calls.append(1) or gemm(*a))
    x, _, _, gate_up, down = _case(75, 128, 64, 9, S=1, k=1)
    ids, w = np.zeros((75, 1), np.int32), np.ones((75, 1), np.float32)
    out = experts.cpu(x, ids, w, gate_up, down, bf16=True)
    assert calls == [1]
    assert_spec("dense", experts.ref(x, ids, w, gate_up, down, bf16=True), out,
                experts.ref(x, ids, w, gate_up, down, bf16=False))


@needs_bf16
def test_the_tiles_run_in_passes_of_whole_experts(monkeypatch):
    """A pass takes whole experts up to PASS_PAIRS pairs (an expert over it is a pass of its own)."""
    monkeypatch.setattr(experts, "BLAS_MIN_PAIRS", 0)
    monkeypatch.setattr(experts_bf16, "PASS_PAIRS", 40)
    passes = []
    one = experts_bf16._pass
    monkeypatch.setattr(experts_bf16, "_pass", lambda *a: passes.append(a[5].shape[0]) or one(*a))
    x, ids, w, gate_up, down = _case(200, 256, 128, 8, S=16, k=4)
    out = experts.cpu(x, ids, w, gate_up, down, bf16=True)
    assert len(passes) > 3 and sum(passes) == int((ids >= 0).sum()) - 1      # one duplicate id merged
    assert_spec("passes", experts.ref(x, ids, w, gate_up, down, bf16=True), out,
                experts.ref(x, ids, w, gate_up, down, bf16=False))


@needs_bf16
def test_the_compiled_tile_product_is_its_python_spec():
    from freetoken.kernels._numba import njit
    rng = np.random.default_rng(3)
    w = from_f32(rng.standard_normal((8, 64), np.float32)).view(np.uint32)          # [R,K/2]
    xt = from_f32(rng.standard_normal((4, 32, 32), np.float32)).view(np.uint32)     # [NT,K/2,16]
    spec, got = np.zeros((8, 4, 16), np.float32), np.zeros((8, 4, 16), np.float32)
    _simd.btile_bf16(w, xt, 4, 2, spec)

    @njit()
    def compiled(w, xt, out):
        _simd.btile_bf16(w, xt, np.int64(4), np.int64(2), out)

    compiled(w, xt, got)
    assert_close("btile_bf16", spec, got, atol=1e-5, rtol=1e-5)
    assert not got[:4].any() and not got[:, :2].any()           # only rows 4..7, tiles 2..3


@pytest.mark.parametrize("K", [64, 96, 34])
def test_the_compiled_decode_row_dots_are_their_python_spec(K):
    """_simd.bdot_rows2/4 compiled (vdpbf16ps on AVX512-BF16, fp32 FMAs elsewhere) against their
    Python bodies: 32 and 48 words (whole vector steps of 2 rows and of 4, and words after them),
    17 (words after the steps only for 2 rows, one after a step for 4)."""
    from freetoken.kernels._numba import njit

    @njit(cache=False)
    def both(w, xw, rows):
        return (_simd.bdot_rows2(w, xw, rows[0], rows[1]),
                _simd.bdot_rows4(w, xw, rows[2], rows[3], rows[4], rows[5]))

    rng = np.random.default_rng(K)
    w = from_f32(rng.standard_normal((9, K)).astype(np.float32)).view(np.uint32)
    xw = from_f32(rng.standard_normal(K).astype(np.float32)).view(np.uint32)
    rows = np.array([7, 2, 8, 0, 3, 3], np.int64)
    got = both(w, xw, rows)
    want = (_simd.bdot_rows2(w, xw, 7, 2), _simd.bdot_rows4(w, xw, 8, 0, 3, 3))
    assert_close("bdot_rows", np.array(want[0] + want[1]), np.array(got[0] + got[1]), atol=1e-5, rtol=1e-5)


def test_the_numba_rounding_gives_the_specs_bits():
    """experts_pairs' two numba roundings (inside the decode GEMV's numba call: bf16 words, and fp32
    values on a CPU without AVX512-BF16) against rounded_bf16, bit for bit: ties to even both ways,
    NaN, infinities, signed zero, subnormals, a bf16 max overflow; the even value of each pair in
    the word's low half."""
    from freetoken.kernels.experts_pairs import _bf16_words, _rounded_bf16
    edges = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x7FC00001, 0xFF800000, 0x7F800000,
                      0x80000000, 0x00000001, 0x00408000, 0x7F7FFFFF], np.uint32).view(np.float32)
    a = np.concatenate([edges, np.random.default_rng(3).standard_normal(4093).astype(np.float32) * 1e3]).reshape(3, -1)
    want = experts_bf16.rounded_bf16(a)
    for got in (to_f32(_bf16_words(a).view(np.uint16)), _rounded_bf16(a)):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
