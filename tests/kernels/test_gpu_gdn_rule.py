"""gdn_rule.gpu vs ref on the device: decode and varlen prefill (the kernel loops tokens), GVA
and Hv == Hk, shuffled state rows; outputs are poisoned (NaN) before the launch, so a row the
kernel missed shows up, and unused state rows must come back bit for bit."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy, emulated
from freetoken.kernels import gdn_rule
from tests.kernels.test_gdn_rule import (NON_FINITE, TOL, assert_follows, random_args,
                                         ref_on_bad_input, run)

pytestmark = pytest.mark.gpu


def _gpu(args):
    """(out, states) of gpu on device copies of ``args``."""
    cp = load_cupy()
    dev = [cp.asarray(a) for a in args]
    out = cp.full(args[2].shape, np.nan, cp.float32)
    assert gdn_rule.gpu(*dev, out) is out
    return out.get(), dev[7].get()


def check_gpu(args):
    expect, expect_states = run(gdn_rule.ref, args)
    got, states = _gpu(args)
    np.testing.assert_allclose(got, expect, **TOL)
    np.testing.assert_allclose(states, expect_states, **TOL)
    unused = np.setdiff1d(np.arange(states.shape[0]), args[8])
    np.testing.assert_array_equal(states[unused], args[7][unused])


@pytest.mark.parametrize("B,Hk,Hv,Dk,Dv", [(1, 1, 1, 16, 32), (5, 2, 4, 40, 37), (3, 3, 3, 8, 70),
                                           (2, 1, 2, 33, 1)])
def test_gpu_decode(B, Hk, Hv, Dk, Dv):
    check_gpu(random_args(np.random.default_rng(B * Dk + Dv), [1] * B, Hk, Hv, Dk, Dv,
                          N=2 * B + 1))


@pytest.mark.parametrize("lens", [[65], [3, 0, 1, 20], [64, 2]])
@pytest.mark.parametrize("init", [0.0, 0.5])
def test_gpu_prefill_varlen(lens, init):
    check_gpu(random_args(np.random.default_rng(sum(lens)), lens, 2, 4, 16, 24, init=init))


@pytest.mark.parametrize("decay", [1e-3, 30.0])
def test_gpu_long_memory_and_strong_decay(decay):
    check_gpu(random_args(np.random.default_rng(3), [40, 1], 1, 2, 24, 8, decay=decay))


def test_gpu_empty_batch_and_empty_sequences():
    for lens in ([], [0, 0]):
        args = random_args(np.random.default_rng(4), lens, N=3)
        got, states = _gpu(args)
        assert got.shape == (0, 4, 8)
        np.testing.assert_array_equal(states, args[7])


def test_gpu_wrong_shapes_are_refused():
    cp = load_cupy()
    dev = [cp.asarray(a) for a in random_args(np.random.default_rng(5), [2, 1])]
    with pytest.raises(AssertionError, match="out"):
        gdn_rule.gpu(*dev, cp.empty((3, 4, 7), cp.float32))
    dev[5] = dev[5][:2]                              # A_log [2] for 4 value heads
    with pytest.raises(AssertionError):
        gdn_rule.gpu(*dev, cp.empty((3, 4, 8), cp.float32))


@pytest.mark.heavy
@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [1] * 16, [130, 1]])
def test_gpu_qwen_shape(lens):
    """Qwen3.6's GDN layer: Hk 16, Hv 32, Dk = Dv = 128; decode at batch 4 and 16, a prefill
    over two chunk edges beside a decode sequence."""
    check_gpu(random_args(np.random.default_rng(len(lens)), lens, 16, 32, 128, 128, init=0.1))


def test_the_key_dim_bound_comes_from_the_registers():
    """ptxas's ~120 registers a thread let a block hold 17 warps (Dk <= 272), not the 32 of
    Dk = 512; one past the bound is refused by the wrapper, naming it, before any launch."""
    widest = gdn_rule.max_key_dim()
    assert 128 <= widest < 512 and widest % gdn_rule.ROWS_PER_THREAD == 0
    with pytest.raises(ValueError, match=f"takes 1 to {widest}"):
        _gpu(random_args(np.random.default_rng(6), [1], 1, 1, widest + 1, 8))


@pytest.mark.heavy
def test_gpu_widest_key_head():
    """The largest Dk the kernel's registers allow runs and matches ref."""
    check_gpu(random_args(np.random.default_rng(6), [3, 1], 1, 2, gdn_rule.max_key_dim(), 40))


def test_device_refuses_a_block_beyond_the_registers():
    """Dk = 512 once launched 1024 threads x ~120 registers (122,880 > 65,536): a real launch
    fails with CUDA's code (seen on an H200), and so does the emulated one, naming the limit."""
    from freetoken.device_limits import TOO_MANY_REGISTERS
    from freetoken.kernels import _cuda
    cp = load_cupy()
    kern = _cuda.kernel("gdn_rule", "gdn_rule_f32")
    args = tuple(cp.zeros(1, cp.float32) for _ in range(11)) + tuple(np.int32(n) for n in (1, 1, 512, 8))
    with pytest.raises(Exception, match=TOO_MANY_REGISTERS) as err:
        kern((1, 1, 1), (1024,), args)
        cp.cuda.runtime.deviceSynchronize()
    assert "1024 threads" in str(err.value) or not emulated()
    assert kern.max_threads_per_block < 1024


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("case", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_gpu_follows_ref_on_non_finite_inputs(case, s):
    """The rule in gdn_rule's docstring on the device: a NaN or inf in one sequence's q, k, v or
    gates spoils what ref spoils (its outputs from the bad token, its state row) and leaks into no
    other sequence's outputs or row. out starts at 7.0, not NaN, so a missed write is not read
    as the rule's NaN."""
    cp = load_cupy()
    args, _, want, want_states = ref_on_bad_input(case, s)
    dev = [cp.asarray(a) for a in args]
    out = cp.full(want.shape, 7.0, cp.float32)
    gdn_rule.gpu(*dev, out)
    assert_follows(out.get(), want, case)
    assert_follows(dev[7].get(), want_states, case)
