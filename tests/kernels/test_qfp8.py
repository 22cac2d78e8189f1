"""Qwen's block FP8 as row blocks (kernels/qfp8.py): the e4m3fn table, the re-layout of a
checkpoint's codes and [128, 128] scales, and the numba row kernels against the spec."""
import numpy as np
import pytest
from freetoken.kernels.qformats import random_blocks

from freetoken.kernels import qblocks
from freetoken.kernels.qfp8 import dequantize_fp8, e4m3_table, to_row_blocks
from freetoken.kernels.qformats import dequantize_ref, format_named, logical_shape


def test_e4m3fn_values():
    t = e4m3_table()
    assert t[0x38] == 1.0 and t[0x7E] == 448.0 and t[0xFE] == -448.0 and t[0x01] == 2.0 ** -9
    assert t[0x08] == 2.0 ** -6 and t[0x80] == 0.0 and np.signbit(t[0x80])
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF]) and np.isfinite(np.delete(t, [0x7F, 0xFF])).all()


def test_row_blocks_carry_each_rows_tile_scale():
    rng = np.random.default_rng(0)
    M, K = 200, 256                                   # two row tiles, the second partial
    codes = rng.integers(0, 0x7E, (M, K), dtype=np.uint8)
    scales = rng.random((2, 2)).astype(np.float32)
    w = to_row_blocks(codes, scales)
    assert w.shape == (M, 2, 132) and format_named("fp8_b128").nbytes == 132 and logical_shape(w) == (M, K)
    want = e4m3_table()[codes] * np.repeat(np.repeat(scales, 128, 0), 128, 1)[:M]
    np.testing.assert_array_equal(dequantize_ref(w), want)
    bf16_scales = (scales.view(np.uint32) & 0xFFFF0000).view(np.float32)   # bf16 widens exactly
    np.testing.assert_array_equal(dequantize_fp8(to_row_blocks(codes, bf16_scales))[130], e4m3_table()[codes[130]]
                                  * np.repeat(bf16_scales[1], 128))


def test_numba_rows_match_the_spec():
    rng = np.random.default_rng(1)
    w = random_blocks("fp8_b128", (9,), 384, rng)
    w[0, 0, 4:8] = [0x7F, 0xFF, 0x80, 0x01]          # NaN codes, -0, the smallest subnormal
    code = format_named("fp8_b128").code
    out = np.empty(384, np.float32)
    for r in range(9):
        qblocks.dequant_row(w[r], code, out)
        np.testing.assert_array_equal(out, dequantize_fp8(w[r]))
    x = rng.standard_normal(384).astype(np.float32)
    ok = w[1:]
    dots = np.empty(8, np.float32)
    qblocks.dot_rows(ok, code, x, dots)
    np.testing.assert_allclose(dots, dequantize_fp8(ok) @ x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        qblocks.dot_row(ok[0], format_named("q8_0").code, x)


def test_the_dots_decode_every_code_exactly():
    """dot_row's branch-free e4m3 decode: a row of one code, scale 1, x = (1, 0, ...): that code's
    value as the table has it (a NaN code NaN)."""
    from freetoken.kernels.qblocks import dot_row
    from freetoken.kernels.qfp8 import e4m3_table
    table = e4m3_table()
    x = np.zeros(256, np.float32)
    x[0] = 1.0
    for c in range(256):
        row = np.full((2, 132), c, np.uint8)
        row[:, :4] = np.float32(1.0).reshape(1).view(np.uint8)
        got = dot_row(row, 10, x)
        assert (np.isnan(got) and np.isnan(table[c])) or got == table[c], (c, got, table[c])
