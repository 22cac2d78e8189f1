"""gdn_conv.gpu vs ref on the device: varlen batches (sequences longer than the kernel's 64-token
chunks, shorter than K-1, empty), K 1 to 8, bf16 and f32 weights; out poisoned with NaN, the
whole state array compared (rows no sequence names must be untouched)."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import gdn_conv
from tests.helpers import assert_close
from tests.kernels.test_gdn_conv import TOL, assert_follows, varlen_args, with_bad_inputs

pytestmark = pytest.mark.gpu
CASES = [  # (lens, C, K)
    ([1], 7, 4), ([3, 0, 1, 2], 37, 4), ([130], 300, 4), ([64, 65, 1, 63], 33, 4),
    ([2, 1], 40, 2), ([5, 3], 33, 1), ([5, 66, 1], 65, 8), ([1] * 16, 257, 4),
]


def _gpu(args):
    """(out, states) of gpu on device copies of args; the caller's arrays stay as they are."""
    cp = load_cupy()
    x, w, states, slots, starts = (cp.asarray(a) for a in args)
    out = cp.full(x.shape, np.nan, cp.float32)
    assert gdn_conv.gpu(x, w, states, slots, starts, out) is out
    return out.get(), states.get()


def _check(args, name):
    ref_states = args[2].copy()
    expect = gdn_conv.ref(args[0], args[1], ref_states, args[3], args[4])
    out, states = _gpu(args)
    assert_close(f"{name} out", expect, out, **TOL)
    np.testing.assert_array_equal(states, ref_states)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("lens,C,K", CASES, ids=[f"{len(c[0])}seq-C{c[1]}-K{c[2]}" for c in CASES])
def test_gpu_matches_ref(lens, C, K, dtype):
    args = varlen_args(np.random.default_rng(C * K + len(lens)), lens, C, K, len(lens) + 3, dtype)
    _check(args, f"gdn_conv gpu {lens} C{C} K{K}")


def test_gpu_two_calls_equal_one():
    cp = load_cupy()
    x, w, states, _, _ = varlen_args(np.random.default_rng(4), [70], 45, 4, 2)
    slot = cp.asarray(np.array([1], np.int32))
    dx, dw, one, two = cp.asarray(x), cp.asarray(w), cp.asarray(states), cp.asarray(states)
    whole = cp.empty((70, 45), cp.float32)
    gdn_conv.gpu(dx, dw, one, slot, cp.asarray(np.array([0, 70], np.int32)), whole)
    parts = []
    for a, b in ((0, 2), (2, 69), (69, 70)):                # 2 < K-1 tokens, then 67, then 1
        part = cp.empty((b - a, 45), cp.float32)
        gdn_conv.gpu(dx[a:b], dw, two, slot, cp.asarray(np.array([0, b - a], np.int32)), part)
        parts.append(part.get())
    assert_close("two calls", whole.get(), np.concatenate(parts), 1e-6, 1e-6)
    np.testing.assert_array_equal(two.get(), one.get())


def test_gpu_no_tokens_launches_nothing():
    args = varlen_args(np.random.default_rng(5), [0, 0], 16, 4, 3)
    out, states = _gpu(args)
    assert out.shape == (0, 16)
    np.testing.assert_array_equal(states, args[2])


def test_gpu_refuses_a_kernel_too_long():
    cp = load_cupy()
    x, w, states, slots, starts = (cp.asarray(a) for a in
                                   varlen_args(np.random.default_rng(6), [2], 8, 9, 1, "f32"))
    with pytest.raises(AssertionError, match="K"):
        gdn_conv.gpu(x, w, states, slots, starts, cp.empty(x.shape, cp.float32))


@pytest.mark.heavy
@pytest.mark.parametrize("lens", [[1] * 16, [300, 5, 129, 1]], ids=["decode16", "prefill"])
def test_gpu_qwen36_shapes(lens):
    """Qwen3.6: 8192 conv channels, kernel 4; decode of 16 sequences and a mixed prefill."""
    args = varlen_args(np.random.default_rng(len(lens)), lens, 8192, 4, 32)
    _check(args, f"gdn_conv gpu qwen3.6 {len(lens)} seqs")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_gpu_follows_ref_on_non_finite_inputs(bad):
    """A NaN or inf stays in the windows and the state row ref puts it in, no other channel or
    sequence. out starts at 7.0, not NaN, so a missed write is not read as the rule's NaN."""
    cp = load_cupy()
    args, _, _ = with_bad_inputs(bad)
    want_states = args[2].copy()
    with np.errstate(all="ignore"):
        want = gdn_conv.ref(args[0], args[1], want_states, args[3], args[4])
    x, w, states, slots, starts = (cp.asarray(a) for a in args)
    out = cp.full(x.shape, 7.0, cp.float32)
    gdn_conv.gpu(x, w, states, slots, starts, out)
    assert_follows(out.get(), want)
    assert_follows(states.get(), want_states)
