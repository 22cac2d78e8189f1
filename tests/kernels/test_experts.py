"""experts: cpu vs ref over the GEMV and BLAS paths (bf16 and fp32 banks, duplicate ids, -1 ids),
and ref against a float64 SwiGLU written out by hand."""
import numpy as np
import pytest

from freetoken.kernels import experts
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close


def banks(rng, S, H, I, dtype):
    gate_up = (rng.standard_normal((S, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((S, H, I)) / np.sqrt(I)).astype(np.float32)
    if dtype == np.uint16:
        return from_f32(gate_up), from_f32(down)
    return gate_up, down


def routing(rng, T, S, k):
    ids = np.stack([rng.permutation(S)[:k] for _ in range(T)]).astype(np.int32)
    ids[0, -1] = ids[0, 0]                                 # duplicate id in a row
    ids[T // 2, 1:] = -1                                   # a row with one expert
    ids[-1, :] = -1 if T > 2 else ids[-1, :]               # a row with none
    w = rng.random((T, k)).astype(np.float32)
    return ids, w


@pytest.mark.parametrize("path", ["gemv", "blas"])
@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("T", [1, 3, 7, 33])
# Odd widths (bf16 rows read element by element) are covered by test_linear's K 97: here each
# extra weight layout costs two more parallel kernels to compile on a cold numba cache.
@pytest.mark.parametrize("H,I", [(96, 40), (200, 72)])
def test_cpu_matches_ref(T, H, I, dtype, path, monkeypatch):
    monkeypatch.setattr(experts, "BLAS_MIN_PAIRS", 0 if path == "blas" else 1 << 30)
    rng = np.random.default_rng(T * H + I)
    S, k = 9, 4
    gate_up, down = banks(rng, S, H, I, dtype)
    ids, w = routing(rng, T, S, k)
    x = rng.standard_normal((T, H)).astype(np.float32)
    expect = experts.ref(x, ids, w, gate_up, down)
    out = np.full((T, H), np.nan, np.float32)              # overwritten, not accumulated
    assert experts.cpu(x, ids, w, gate_up, down, out=out) is out
    assert_close(f"experts T{T} H{H} I{I}", expect, out, atol=1e-5, rtol=1e-4)
    if T > 2:
        np.testing.assert_array_equal(out[-1], 0.0)


def test_all_ids_negative_gives_zeros():
    rng = np.random.default_rng(1)
    gate_up, down = banks(rng, 3, 96, 40, np.uint16)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    out = experts.cpu(x, np.full((2, 2), -1, np.int32), np.ones((2, 2), np.float32), gate_up, down)
    np.testing.assert_array_equal(out, 0.0)


def test_out_of_range_id_raises():
    rng = np.random.default_rng(2)
    gate_up, down = banks(rng, 3, 96, 40, np.float32)
    with pytest.raises(IndexError):
        experts.cpu(np.zeros((1, 96), np.float32), np.array([[3]], np.int32),
                    np.ones((1, 1), np.float32), gate_up, down)


def test_ref_matches_float64_swiglu():
    rng = np.random.default_rng(3)
    H, I = 96, 40
    gate_up, down = banks(rng, 4, H, I, np.uint16)
    x = rng.standard_normal((2, H)).astype(np.float32)
    ids = np.array([[2, 0], [1, 1]], np.int32)
    w = np.array([[0.7, 0.3], [0.25, 0.5]], np.float32)
    expect = np.zeros((2, H))
    for t in range(2):
        for j in range(2):
            gu = to_f32(gate_up[ids[t, j]]).astype(np.float64) @ x[t].astype(np.float64)
            g, u = gu[:I], gu[I:]
            expect[t] += w[t, j] * (to_f32(down[ids[t, j]]).astype(np.float64)
                                    @ (g / (1 + np.exp(-g)) * u))
    assert_close("experts ref vs f64", expect, experts.ref(x, ids, w, gate_up, down), 1e-6, 1e-5)


def test_plan_groups_pairs_by_expert_and_merges_duplicates():
    ids = np.array([[3, 1, 3], [-1, 3, 0]], np.int32)
    w = np.array([[0.5, 0.25, 0.125], [9.0, 1.0, 2.0]], np.float32)
    uniq, offs, ptok, pw = experts._plan(ids, w, 4)
    np.testing.assert_array_equal(uniq, [0, 1, 3])
    np.testing.assert_array_equal(offs, [0, 1, 2, 4])
    np.testing.assert_array_equal(ptok, [1, 0, 0, 1])
    np.testing.assert_array_equal(pw, [2.0, 0.25, 0.625, 1.0])
