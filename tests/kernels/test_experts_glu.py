"""experts with per-expert biases and gpt-oss's clamped SwiGLU (bias=, glu=; kernels/experts_glu.py):
ref against a float64 formula written from the definition (clamps active), cpu against ref on bf16,
fp32, q8_0 and mxfp4 banks at decode and prefill sizes, roundings on and off, each keyword alone,
the defaults unchanged (gpu: test_gpu_experts_glu.py)."""
import numpy as np
import pytest

from freetoken.kernels import experts
from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.kernels.qformats import dequantize_ref, random_blocks
from tests.helpers import assert_close
from tests.kernels.test_experts_bf16 import assert_spec
from tests.kernels.test_experts_quant import assert_close_but_for_rounding_flips

GLU = (1.702, 7.0)          # gpt-oss's alpha and limit
SOFT = (0.25, 2.0)          # at alpha 1.702 a gate clamped from below too differs by < 1e-4: here it shows
S, K, H, I = 8, 4, 128, 64


def make_banks(rng, kind):
    if kind in ("bf16", "f32"):
        gate_up = (rng.standard_normal((S, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
        down = (rng.standard_normal((S, H, I)) / np.sqrt(I)).astype(np.float32)
        return (from_f32(gate_up), from_f32(down)) if kind == "bf16" else (gate_up, down)
    return random_blocks(kind, (S, 2 * I), H, rng), random_blocks(kind, (S, H), I, rng)


def dense(w):
    return dequantize_ref(w) if w.dtype == np.uint8 else to_f32(w) if w.dtype == np.uint16 else w


def make_case(rng, kind, T):
    """Banks, routing (a duplicate id in row 0, -1 ids, a row routed nowhere), biases, and x scaled
    so that gate_up's outputs have a standard deviation near 5: the clamps at 7 are active."""
    gate_up, down = make_banks(rng, kind)
    ids = rng.integers(0, S, (T, K)).astype(np.int32)
    ids[0, 1] = ids[0, 0]
    ids[min(1, T - 1), 2] = -1
    if T > 2:
        ids[-1] = -1
    w = rng.random((T, K)).astype(np.float32)
    bias = (rng.standard_normal((S, 2 * I)).astype(np.float32), rng.standard_normal((S, H)).astype(np.float32))
    x = rng.standard_normal((T, H)).astype(np.float32) * np.float32(5 / (dense(gate_up).std() * np.sqrt(H)))
    return x, ids, w, gate_up, down, bias


def float64_experts(x, ids, w, gate_up, down, bias, glu, gate_floor=-np.inf):
    """The definition in float64; also the (g, u) pairs it saw, to check the clamps were active.
    gate_floor: a wrong reading (the gate clamped from below too), to show a test would see it."""
    gu, dn = dense(gate_up).astype(np.float64), dense(down).astype(np.float64)
    out, seen = np.zeros(x.shape), []
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            h = gu[e] @ x[t].astype(np.float64) + (bias[0][e] if bias is not None else 0.0)
            g, u = h[:I], h[I:]
            seen.append(h)
            if glu is None:
                act = g / (1 + np.exp(-g)) * u
            else:
                alpha, limit = glu
                g, u = np.clip(g, gate_floor, limit), np.clip(u, -limit, limit)
                act = (u + 1) * g / (1 + np.exp(-alpha * g))
            out[t] += w[t, j] * (dn[e] @ act + (bias[1][e] if bias is not None else 0.0))
    return out, np.concatenate(seen)


@pytest.mark.parametrize("glu", [None, GLU, SOFT])
@pytest.mark.parametrize("with_bias", [False, True])
def test_ref_matches_float64_definition(with_bias, glu):
    rng = np.random.default_rng(11)
    x, ids, w, gate_up, down, bias = make_case(rng, "f32", 6)
    bias = bias if with_bias else None
    want, h = float64_experts(x, ids, w, gate_up, down, bias, glu)
    for part in (h[:I], h[I:]):                      # gate and up each beyond +-limit somewhere
        assert (part > 7.0).mean() > 0.02 and (part < -7.0).mean() > 0.02
    got = experts.ref(x, ids, w, gate_up, down, bias=bias, glu=glu)
    assert_close(f"ref bias={with_bias} glu={glu}", want, got, atol=1e-5 * np.abs(want).max(), rtol=1e-4)
    np.testing.assert_array_equal(got[-1], 0.0)     # routed nowhere: no bias either
    if glu is not None:                              # the clamps changed the answer
        unclamped, _ = float64_experts(x, ids, w, gate_up, down, bias, (glu[0], 1e9))
        assert np.abs(unclamped - want).max() > 0.1 * np.abs(want).max()
    if glu == SOFT:
        floored, _ = float64_experts(x, ids, w, gate_up, down, bias, glu, gate_floor=-glu[1])
        assert np.abs(floored - want).max() > 0.01 * np.abs(want).max()


@pytest.mark.parametrize("rounded", [False, True])   # bf16=True (bf16 banks), dots="int8" (quantized)
@pytest.mark.parametrize("kind", ["bf16", "f32", "q8_0", "mxfp4"])
@pytest.mark.parametrize("T", [1, 3, 200])           # 200 tokens x 4 over 8 experts: the BLAS path
def test_cpu_matches_ref(T, kind, rounded):
    rng = np.random.default_rng(T + 7)
    x, ids, w, gate_up, down, bias = make_case(rng, kind, T)
    keys = dict(dots="int8" if rounded else "f32", bf16=rounded, bias=bias, glu=GLU)
    want = experts.ref(x, ids, w, gate_up, down, **keys)
    out = np.full((T, H), np.nan, np.float32)
    assert experts.cpu(x, ids, w, gate_up, down, out=out, **keys) is out
    if rounded and kind == "bf16":
        assert_spec(f"bf16 T{T}", want, out, experts.ref(x, ids, w, gate_up, down, bias=bias, glu=GLU))
    elif rounded and kind != "f32":
        assert_close_but_for_rounding_flips(out, want, "int8")
    else:
        assert_close(f"{kind} T{T}", want, out, atol=1e-5 * np.abs(want).max(), rtol=1e-4)
    if T > 2:
        np.testing.assert_array_equal(out[-1], 0.0)


@pytest.mark.parametrize("which", ["bias", "glu", "soft glu"])
@pytest.mark.parametrize("T", [3, 200])
def test_each_keyword_alone(T, which):
    rng = np.random.default_rng(5)
    x, ids, w, gate_up, down, bias = make_case(rng, "bf16", T)
    keys = {"bias": {"bias": bias}, "glu": {"glu": GLU}, "soft glu": {"glu": SOFT}}[which]
    want = experts.ref(x, ids, w, gate_up, down, **keys)
    assert not np.allclose(want, experts.ref(x, ids, w, gate_up, down), rtol=1e-2)
    got = experts.cpu(x, ids, w, gate_up, down, **keys)
    assert_close(f"{which} T{T}", want, got, atol=1e-5 * np.abs(want).max(), rtol=1e-4)


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
@pytest.mark.parametrize("T", [1, 3, 200])
def test_defaults_unchanged_and_zero_bias_through_the_general_paths(T, kind):
    """bias=None, glu=None is today's op bit for bit (one thread: the BLAS pool's sums are added in
    the order the threads finish); zero biases take the general paths and give the same numbers
    within fp32 (and the int8 or bf16 rounding's flips) as the specialised ones."""
    import numba
    rng = np.random.default_rng(T)
    x, ids, w, gate_up, down, _ = make_case(rng, kind, T)
    keys = dict(dots="int8", bf16=True)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        plain = experts.cpu(x, ids, w, gate_up, down, **keys)
        np.testing.assert_array_equal(plain, experts.cpu(x, ids, w, gate_up, down, bias=None, glu=None, **keys))
    finally:
        numba.set_num_threads(threads)
    zeros = (np.zeros((S, 2 * I), np.float32), np.zeros((S, H), np.float32))
    general = experts.cpu(x, ids, w, gate_up, down, bias=zeros, **keys)
    if kind == "bf16":
        assert_spec(f"zero bias T{T}", plain, general, experts.ref(x, ids, w, gate_up, down))
    else:
        assert_close_but_for_rounding_flips(general, plain, "int8")


def test_no_pairs_and_wrong_bias_shapes():
    rng = np.random.default_rng(1)
    _, _, _, gate_up, down, bias = make_case(rng, "q8_0", 1)
    x = rng.standard_normal((2, H)).astype(np.float32)
    none = experts.cpu(x, np.full((2, K), -1, np.int32), np.ones((2, K), np.float32), gate_up, down, bias=bias, glu=GLU)
    np.testing.assert_array_equal(none, 0.0)
    empty = experts.cpu(x[:0], np.zeros((0, K), np.int32), np.zeros((0, K), np.float32), gate_up, down, bias=bias)
    assert empty.shape == (0, H)
    ids, w = np.zeros((2, K), np.int32), np.ones((2, K), np.float32)
    with pytest.raises(ValueError, match="biases"):
        experts.cpu(x, ids, w, gate_up, down, bias=(bias[0][:, :I], bias[1]))


@pytest.mark.parametrize("kind", ["q8_0", "mxfp4"])
def test_many_tokens_with_int8_dots_take_the_tile_gemm(kind, monkeypatch):
    """200 tokens x 4 over 8 experts with int8 dots: experts_glu.tile_gemm (the int8 tile GEMM's
    passes, _glu between, down's bias as routing @ biases), here too where the CPU has no VNNI
    (its widening fallback is exact, so fast_here is forced)."""
    from freetoken.kernels import experts_glu, qgemm
    monkeypatch.setattr(qgemm, "fast_here", lambda: True)
    taken = []
    real = experts_glu.tile_gemm
    monkeypatch.setattr(experts_glu, "tile_gemm", lambda *a: taken.append(1) or real(*a))
    x, ids, w, gate_up, down, bias = make_case(np.random.default_rng(9), kind, 200)
    for keys in (dict(bias=bias, glu=GLU), dict(glu=SOFT), dict(bias=bias)):
        want = experts.ref(x, ids, w, gate_up, down, dots="int8", **keys)
        got = experts.cpu(x, ids, w, gate_up, down, dots="int8", **keys)
        assert_close_but_for_rounding_flips(got, want, "int8")
        np.testing.assert_array_equal(got[-1], 0.0)
    assert len(taken) == 3
