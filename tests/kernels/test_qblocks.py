"""qblocks: GGUF quantized blocks against gguf-py's ``dequantize`` (the spec): the format table and
its lookups, ``dequant_row`` bit for bit, ``dot_row``/``dot_rows`` within fp32 tolerance, on random
blocks of every format (random bytes, finite fp16 scales) and on blocks gguf-py quantized."""
import subprocess
import sys

import numpy as np
import pytest

from freetoken.kernels import qblocks, qformats
from tests.helpers import assert_close

FORMATS = [f.name for f in qformats.FORMATS if f.ggml >= 0]     # GGUF's (FP8: tests/kernels/test_qfp8.py)
FP16_AT = {  # byte offsets of each format's fp16 scale fields (d, and dmin or m where it has one)
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
    "mxfp4": ()}                                                # its scale: an e8m0 byte at 0
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF], np.uint16)


def blocks(rng, name, rows, nb):
    """u8[rows, nb, S] of random bytes with finite fp16 scales: in [-1, 1] for the 32-value
    formats, small and positive (as in real files) for the K-quants' super-block scales."""
    fmt = qformats.format_named(name)
    w = rng.integers(0, 256, (rows, nb, fmt.nbytes), dtype=np.uint8)
    for at in FP16_AT[name]:
        lo, hi = (-1, 1) if fmt.values == 32 else (0, 0.05)
        scale = rng.uniform(lo, hi, (rows, nb))
        w[..., at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if name == "mxfp4":         # scales 2**-28 .. 2**6: no product overflows (every exponent: below)
        w[..., 0] = rng.integers(100, 134, (rows, nb), dtype=np.uint8)
    return w


def dequant_rows(w):
    fmt = qformats.format_of(w)
    out = np.full((w.shape[0], w.shape[1] * fmt.values), np.nan, np.float32)
    for r in range(w.shape[0]):
        qblocks.dequant_row(w[r], fmt.code, out[r])
    return out


def assert_bits_equal(name, ref, out):
    assert ref.shape == out.shape and ref.dtype == out.dtype == np.float32, (ref.shape, out.shape)
    bad = np.flatnonzero(ref.view(np.uint32) != out.view(np.uint32))
    assert bad.size == 0, (f"{name}: {bad.size} values differ in bits, first at {bad[0]}: "
                           f"ref {ref.flat[bad[0]]!r}, out {out.flat[bad[0]]!r}")


def test_mxfp4_every_exponent_and_code_bit_exact():
    """All 256 e8m0 exponents (subnormal scales at 0 and 1, infinities from 12 * 2**127) with
    every code, as gguf-py dequantizes them; the CUDA loads alike: tests/kernels/test_gpu_quant.py."""
    w = np.zeros((1, 256, 17), np.uint8)
    w[0, :, 0] = np.arange(256)
    w[0, :, 1:] = np.arange(16, dtype=np.uint8) * 17                 # codes c in both nibbles
    with np.errstate(over="ignore"):
        ref = qformats.dequantize_ref(w)
    assert_bits_equal("mxfp4", ref, dequant_rows(w))


def test_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    assert len({f.nbytes for f in qformats.FORMATS}) == len(qformats.FORMATS)
    for code, f in enumerate(qformats.FORMATS):
        assert f.code == code
        if f.ggml < 0:                         # FreeToken's own FP8 row blocks: no GGML type
            continue
        t = GGMLQuantizationType(f.ggml)
        assert t.name.lower() == f.name and f.code == code
        assert GGML_QUANT_SIZES[t] == (f.values, f.nbytes)
        assert qformats.format_of_ggml(t) is f and qformats.format_of_ggml(int(t)) is f
        assert qformats.format_named(f.name.upper()) is f
        assert qformats.format_of_block_bytes(f.nbytes) is f


def test_lookup_errors_name_what_was_asked():
    with pytest.raises(ValueError, match="19-byte"):
        qformats.format_of_block_bytes(19)
    with pytest.raises(ValueError, match="q7_x"):
        qformats.format_named("q7_x")
    with pytest.raises(ValueError, match="GGML type 0"):
        qformats.format_of_ggml(0)   # F32
    with pytest.raises(ValueError, match="100-byte"):
        qformats.format_of(np.zeros((3, 2, 100), np.uint8))
    with pytest.raises(ValueError, match="not a quantized weight"):
        qformats.format_of(np.zeros((3, 144), np.float32))


def test_is_quantized():
    assert qformats.is_quantized(np.zeros((4, 2, 144), np.uint8))
    assert qformats.is_quantized(np.zeros((2, 4, 2, 34), np.uint8))
    assert not qformats.is_quantized(np.zeros((4, 144), np.uint16))   # bf16
    assert not qformats.is_quantized(np.zeros((4, 144), np.float32))
    assert not qformats.is_quantized(np.zeros((4, 100), np.uint8))    # no format has 100 bytes
    assert not qformats.is_quantized(np.zeros(144, np.uint8))         # one block is not a weight
    assert not qformats.is_quantized([[0] * 144])


def test_logical_shape():
    assert qformats.logical_shape(np.zeros((3, 4, 8, 144), np.uint8)) == (3, 4, 2048)
    assert qformats.logical_shape(np.zeros((4, 2, 34), np.uint8)) == (4, 64)
    assert qformats.logical_shape(np.zeros((4, 300), np.uint16)) == (4, 300)


def test_import_loads_neither_numba_nor_gguf():
    code = ("import sys, freetoken.kernels.qblocks; "
            "assert not {'numba', 'gguf'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", FORMATS)
def test_dequant_row_is_bit_exact(name):
    rng = np.random.default_rng(FORMATS.index(name))
    w = blocks(rng, name, 6, 5)
    ref = qformats.dequantize_ref(w)
    assert ref.shape == (6, 5 * qformats.format_named(name).values)
    assert_bits_equal(name, ref, dequant_rows(w))


@pytest.mark.parametrize("name", FORMATS)
def test_dequant_row_special_scales(name):
    """Zero, -0, subnormal and the largest fp16 scales, all finite: every branch of the fp16
    conversion (NaN payloads are not part of the contract)."""
    rng = np.random.default_rng(100 + FORMATS.index(name))
    w = blocks(rng, name, 2, len(SPECIAL_F16))
    for at in FP16_AT[name]:
        w[..., at:at + 2] = rng.permutation(SPECIAL_F16).view(np.uint8).reshape(-1, 2)
    assert_bits_equal(name, qformats.dequantize_ref(w), dequant_rows(w))


def test_dequantize_ref_keeps_leading_axes():
    w = blocks(np.random.default_rng(7), "q4_k", 6, 2).reshape(2, 3, 2, 144)
    ref = qformats.dequantize_ref(w)
    assert ref.shape == (2, 3, 512) and ref.dtype == np.float32
    assert_bits_equal("q4_k 4-d", ref.reshape(6, 512), dequant_rows(w.reshape(6, 2, 144)))


def assert_dots_close(name, w, x):
    """dot_row and dot_rows against float64 dequantize_ref(w) @ x: within 1e-5 of the sum of
    |w*x| (the scale of the rounding of an fp32 sum, whatever cancels in it)."""
    wf = qformats.dequantize_ref(w).astype(np.float64)
    expect = wf @ x
    tol = 1e-5 * float((np.abs(wf) @ np.abs(x)).max())
    code = qformats.format_of(w).code
    rows = np.array([qblocks.dot_row(w[r], code, x) for r in range(w.shape[0])], np.float32)
    assert_close(f"{name} dot_row", expect, rows, atol=tol, rtol=1e-5)
    out = np.full(w.shape[0], np.nan, np.float32)
    qblocks.dot_rows(w, code, x, out)
    assert_close(f"{name} dot_rows", expect, out, atol=tol, rtol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_dots_match_ref(name):
    rng = np.random.default_rng(200 + FORMATS.index(name))
    nb = 7 if qformats.format_named(name).values == 32 else 3   # 7: four-block passes + 3 left
    w = blocks(rng, name, 33, nb)
    x = rng.standard_normal(w.shape[1] * qformats.format_named(name).values).astype(np.float32)
    assert_dots_close(name, w, x)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_blocks_quantized_by_gguf(name):
    """Realistic blocks: gguf-py quantizes normal weights (it has no K-quant quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    fmt = qformats.format_named(name)
    rng = np.random.default_rng(300 + fmt.code)
    data = (rng.standard_normal((16, 1024)) / 32).astype(np.float32)
    w = quantize(data, GGMLQuantizationType(fmt.ggml)).reshape(16, -1, fmt.nbytes)
    assert qformats.format_of(w) is fmt
    deq = dequant_rows(w)
    assert_bits_equal(name, qformats.dequantize_ref(w), deq)
    assert np.abs(deq - data).max() < 0.1 * np.abs(data).max()   # it is that data, quantized
    assert_dots_close(name, w, rng.standard_normal(1024).astype(np.float32))


def test_kernels_reject_a_code_that_does_not_fit_the_blocks():
    w = blocks(np.random.default_rng(9), "q4_k", 2, 2)
    x = np.zeros(512, np.float32)
    for code in (-1, 4, 10):
        with pytest.raises(ValueError, match="block size"):
            qblocks.dot_row(w[0], code, x)
        with pytest.raises(ValueError, match="block size"):
            qblocks.dot_rows(w, code, x, np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="block size"):
            qblocks.dequant_row(w[0], code, np.zeros(512, np.float32))
    with pytest.raises(ValueError, match="NB\\*V"):
        qblocks.dequant_row(w[0], 7, np.zeros(256, np.float32))
