"""linear and embedding over GGUF blocks (kernels/linear_quant.py): the numba op against the spec
(linear.ref on gguf-py's dequantization), decode and prefill, with fp32 and int8 dots
(kernels/qact.py), and the stacked-parts form that a GGUF q/k/v of different formats takes."""
import numpy as np
import pytest
from freetoken.kernels.qformats import random_blocks

from freetoken.kernels import embedding, linear
from freetoken.kernels.qact import rounded_ref, wants_int8
from freetoken.kernels.qformats import FORMATS, dequantize_ref


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("dots", ["f32", "int8"])
@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
@pytest.mark.parametrize("T", [1, 5, 40])            # 40 >= BLAS_MIN_T: dequantized row blocks + BLAS
def test_linear_matches_the_spec(fmt, T, dots):
    """int8 dots: x rounded (for the formats that have them) in the spec and in both cpu paths."""
    rng = np.random.default_rng(11)
    w = random_blocks(fmt, (72,), 512, rng)
    x = rng.standard_normal((T, 512)).astype(np.float32)
    want = linear.ref(x, w, dots=dots)
    int8 = wants_int8(w, dots)
    np.testing.assert_array_equal(want, (rounded_ref(x) if int8 else x) @ dequantize_ref(w).T)
    assert int8 == (not np.array_equal(want, linear.ref(x, w)))
    close(linear.cpu(x, w, dots=dots), want)


@pytest.mark.parametrize("dots", ["f32", "int8"])
@pytest.mark.parametrize("T", [1, 40])
def test_parts_of_different_formats_stack_along_the_rows(T, dots):
    rng = np.random.default_rng(5)
    parts = (random_blocks("q4_k", (64,), 256, rng), random_blocks("q4_k", (16,), 256, rng),
             random_blocks("q6_k", (16,), 256, rng))
    x = rng.standard_normal((T, 256)).astype(np.float32)
    x = rounded_ref(x) if dots == "int8" else x           # q4_k and q6_k: both round
    want = x @ np.concatenate([dequantize_ref(p) for p in parts]).T
    close(linear.ref(x, parts, dots=dots), want)        # BLAS per part: its own summation order
    got = linear.cpu(x, parts, dots=dots)
    assert got.shape == (T, 96)
    close(got, want)


@pytest.mark.parametrize("dots", ["f32", "int8"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("formats", [("q4_k", "q6_k"), ("q6_k", "q8_0"), ("q4_k", "q4_0")])
def test_two_parts_of_different_formats_in_one_call(formats, T, dots):
    """The GGUF loader stacks q|k of one format, so a Q4_K_M layer's q/k/v are two parts: decode
    runs them in one call (linear_quant.gemv_pair), each part's x rounded for its own format."""
    rng = np.random.default_rng(6)
    parts = (random_blocks(formats[0], (80,), 256, rng), random_blocks(formats[1], (16,), 256, rng))
    x = rng.standard_normal((T, 256)).astype(np.float32)
    want = np.concatenate([linear.ref(x, p, dots=dots) for p in parts], axis=1)
    out = np.full((T, 96), np.nan, np.float32)
    assert linear.cpu(x, parts, out, dots=dots) is out
    close(out, want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
def test_embedding_rows_are_the_spec(fmt):
    rng = np.random.default_rng(2)
    table = random_blocks(fmt, (50,), 256, rng)
    ids = np.array([3, 0, 49, 3], np.int32)
    want = dequantize_ref(table)[ids]
    np.testing.assert_array_equal(embedding.ref(ids, table), want)
    np.testing.assert_array_equal(embedding.cpu(ids, table), want)    # dequantize_row is bit-exact
