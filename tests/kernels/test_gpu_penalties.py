"""penalties.gpu vs ref on the device, bit for bit (the kernel's steps are unfused __f*_rn
intrinsics); outputs are poisoned (NaN) before the launch, so a logit the copy or the kernel
missed shows up."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import penalties
from tests.kernels.test_penalties import assert_bits, random_args, special_args

pytestmark = pytest.mark.gpu


def _gpu(args, in_place=False):
    cp = load_cupy()
    dev = [cp.asarray(a) for a in args]
    out = dev[0] if in_place else cp.full(args[0].shape, np.nan, cp.float32)
    assert penalties.gpu(*dev, out) is out
    if not in_place:
        assert_bits(dev[0].get(), args[0])            # the caller's logits untouched
    return out.get()


@pytest.mark.parametrize("B,V,N", [(1, 1, 1), (1, 1001, 500), (3, 33, 99), (5, 4099, 2000),
                                   (2, 300, 600), (8, 151936, 2048)])
def test_gpu_matches_ref(B, V, N):
    args = random_args(np.random.default_rng(B * V + N), B, V, N)
    assert_bits(_gpu(args), penalties.ref(*args))


@pytest.mark.parametrize("N", [0, 300])
def test_gpu_in_place(N):
    args = random_args(np.random.default_rng(N + 1), 4, 1000, N)
    assert_bits(_gpu(args, in_place=True), penalties.ref(*args))


def test_gpu_special_values():
    """inf and NaN logits, repetition 0 and NaN, infinite bias: the same values, NaN for NaN."""
    args = special_args()
    with np.errstate(all="ignore"):
        expect = penalties.ref(*args)
    assert_bits(_gpu(args), expect, any_nan=True)


def test_gpu_no_entries_is_a_copy():
    args = random_args(np.random.default_rng(5), 3, 77, 0)
    assert_bits(_gpu(args), args[0])


def test_gpu_wrong_shapes_are_refused():
    cp = load_cupy()
    dev = [cp.asarray(a) for a in random_args(np.random.default_rng(6), 2, 50, 10)]
    with pytest.raises(AssertionError, match="out"):
        penalties.gpu(*dev, cp.empty((2, 49), cp.float32))
    dev[6] = dev[6][:1]                               # presence [1] for a batch of 2
    with pytest.raises(AssertionError, match="presence"):
        penalties.gpu(*dev, cp.empty((2, 50), cp.float32))
