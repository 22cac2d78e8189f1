"""attention.gpu with sinks and a sliding window (gpt-oss) against ref on the device: the split
decode (chunks counted from the window's start, the sink merged in the reduce) and the prefill
tiles (keys before a row's window masked, tiles before the block's earliest window skipped, the
sink merged in the epilogue); contexts shorter and much longer than the window, mixed batches,
bf16 and f32 caches; slots no sequence owns hold NaN and the scratch is poisoned, so reading a
key outside a window shows. Non-finite inputs follow ref; the ops table hands the keywords on."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import attention
from tests.helpers import assert_close, assert_follows_ref
from tests.kernels.test_attention import NON_FINITE, non_finite_step
from tests.kernels.test_attention_sinks import MODES, head_sinks
from tests.kernels.test_gpu_attention import case
from tests.kernels.test_gpu_experts import poison_scratch

pytestmark = pytest.mark.gpu

STEPS = {  # context length per sequence, tokens computed this step (the last ones), G, rep, D
    "decode": ([1, 90, 700, 129], [1, 1, 1, 1], 2, 4, 64),
    "decode-long": ([1500], [1], 1, 8, 128),
    "prefill": ([300], [300], 2, 2, 64),
    "mixed": ([250, 40, 7], [60, 40, 1], 1, 4, 32),
}


def _device_run(args, sinks, window):
    """attention.gpu twice (the first sizes the scratch, then it is poisoned) -> host output."""
    cp = load_cupy()
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    kw = {"sinks": None if sinks is None else cp.asarray(sinks), "window": window}
    out = cp.full(args[0].shape, np.nan, cp.float32)
    attention.gpu(*dev, out, **kw)
    poison_scratch()
    out.fill(np.nan)
    assert attention.gpu(*dev, out, **kw) is out
    return out.get()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("step", list(STEPS))
def test_gpu_matches_ref(step, mode, dtype):
    lens, new, G, rep, D = STEPS[step]
    args = case(lens, new, G, rep, D, dtype, seed=len(mode))
    with_sinks, window = MODES[mode]
    sinks = head_sinks(np.random.default_rng(5), G * rep) if with_sinks else None
    want = attention.ref(*args, sinks=sinks, window=window)
    assert_close(f"{step} {mode} {dtype}", want, _device_run(args, sinks, window), 2e-5, 1e-3)


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_a_window_longer_than_every_context_is_none(step):
    """W beyond every position reads what no window reads, bit for bit (same chunks, same tiles)."""
    args = case(*STEPS[step], "f32", seed=3)
    np.testing.assert_array_equal(_device_run(args, None, 0), _device_run(args, None, 5000))


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NON_FINITE)
def test_gpu_follows_ref_on_non_finite_inputs_with_sinks_and_window(kind, prefill):
    """test_attention's rule cases with a sink on every head and a window of 20: what ref makes
    NaN or inf the kernels do, and a -inf key row leaves the finite sink's share."""
    args = non_finite_step(kind, prefill, np.float32, 64, 4)
    sinks = head_sinks(np.random.default_rng(1), args[0].shape[1])
    with np.errstate(all="ignore"):
        want = attention.ref(*args, sinks=sinks, window=20)
    assert_follows_ref(want, _device_run(args, sinks, 20), rtol=1e-4, atol=2e-5)


def test_the_cuda_ops_table_passes_the_keywords_on():
    """backend's cuda wrapper hands sinks and window on by keyword (the output is ref's)."""
    from freetoken.backend import get_ops
    cp = load_cupy()
    args = case([40, 9], [40, 1], 1, 2, 32, "f32", seed=9)
    sinks = head_sinks(np.random.default_rng(2), 2)
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    got = get_ops("cuda").attention(*dev, sinks=cp.asarray(sinks), window=6)
    assert_close("ops.attention", attention.ref(*args, sinks=sinks, window=6), cp.asnumpy(got), 2e-5, 1e-3)
