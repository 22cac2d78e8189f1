"""q4_0 rows interleaved 16 at a time (kernels/qlayout.py, kernels/qinterleave.py, the 16-row int8
dot of kernels/_simd_interleave.py): the layout holds the same values (dequantize_ref through
deinterleave is the spec), is made in place, and every kernel that reads a cpu engine's expert
bank (decode GEMV, tile GEMM, BLAS path, linear GEMV) gives the file layout's results within
fp32 rounding."""
import numpy as np
import pytest

from freetoken.kernels import experts, linear, linear_quant, qgemm
from freetoken.kernels._numba import njit
from freetoken.kernels._simd import idot_q4_0x16
from freetoken.kernels.qact import dequantize_ref as rounded_values, quantize
from freetoken.kernels.qformats import FORMATS, LAYOUTS, dequantize_ref, format_of, logical_shape, random_blocks
from freetoken.kernels.qinterleave import can_interleave, interleave, row_range
from freetoken.kernels.qlayout import deinterleave, interleave_ref


def test_the_layout_holds_the_same_rows_and_is_made_in_place():
    rng = np.random.default_rng(0)
    w = random_blocks("q4_0", (3, 48), 256, rng)
    keep = w.copy()
    out = interleave(w)
    assert np.shares_memory(out, w) and out.shape == (3, 3, 8, 288)
    assert format_of(out).name == "q4_0x16" and logical_shape(out) == (3, 48, 256)
    np.testing.assert_array_equal(deinterleave(out), keep)
    np.testing.assert_array_equal(interleave_ref(keep), out)         # numpy's way, the same bytes
    np.testing.assert_array_equal(dequantize_ref(out), dequantize_ref(keep))
    assert not can_interleave(out)                                   # twice is refused, not scrambled


def test_a_layouts_block_size_names_it_alone():
    """Formats are told apart by their block bytes (qformats.format_of): 288 is no file format's,
    and the layouts' codes follow the file formats' (the kernels switch on them)."""
    sizes = [f.nbytes for f in FORMATS + LAYOUTS]
    assert len(set(sizes)) == len(sizes)
    assert [f.code for f in FORMATS + LAYOUTS] == list(range(len(sizes)))


@pytest.mark.parametrize("w", [np.zeros((40, 8, 18), np.uint8), np.zeros((32, 8, 34), np.uint8),
                               np.zeros((32, 16, 18), np.uint8)[:, ::2], np.zeros((32, 256), np.float32)],
                         ids=["rows-not-16s", "q8_0", "strided", "dense"])
def test_only_contiguous_q4_0_rows_in_16s_are_taken(w):
    assert not can_interleave(w)
    with pytest.raises(ValueError, match="groups of 16"):
        interleave(w)


@njit(fastmath=True)
def _dots(w, xq, xd, xs, out, column):
    for g in range(w.shape[0]):
        idot_q4_0x16(w[g], xq, xd, xs, out[16 * g:16 * g + 16, column])


def test_the_16_row_dot_is_each_rows_int8_dot():
    """Compiled, into a strided column: the dequantized rows against the rounded x (the spec)."""
    rng = np.random.default_rng(1)
    w = random_blocks("q4_0", (64,), 512, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    q, d, s = quantize(x)
    out = np.full((64, 3), 7.0, np.float32)
    _dots(interleave_ref(w), q.reshape(16, 32), d.reshape(16, 1), s.reshape(16, 1), out, 1)
    want = dequantize_ref(w) @ rounded_values(q, d)[0]
    np.testing.assert_allclose(out[:, 1], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert (out[:, [0, 2]] == 7.0).all()                              # nothing written beside it


def _bank(rng, E=6, H=256, I=128):
    return random_blocks("q4_0", (E, 2 * I), H, rng), random_blocks("q4_0", (E, H), I, rng)


@pytest.mark.parametrize("T", [1, 3, 96])
@pytest.mark.parametrize("tiles", [True, False], ids=["vnni-tiles", "blas"])
def test_experts_read_either_layout_alike(T, tiles, monkeypatch):
    """Decode (T 1, 3) and prefill (96 tokens x 3 over 6 experts: the tile GEMM where there is
    VNNI, else the BLAS path over dequantized rows; both forced here); one bank interleaved, or
    only gate_up (a layer whose down is another format keeps it)."""
    monkeypatch.setattr(qgemm, "fast_here", lambda: tiles)
    rng = np.random.default_rng(2)
    gu, dn = _bank(rng)
    ids = rng.integers(0, 6, (T, 3)).astype(np.int32)
    w = rng.random((T, 3)).astype(np.float32)
    x = rng.standard_normal((T, 256)).astype(np.float32)
    want = experts.cpu(x, ids, w, gu, dn, dots="int8")
    for bank in ((interleave_ref(gu), interleave_ref(dn)), (interleave_ref(gu), dn)):
        got = experts.cpu(x, ids, w, *bank, dots="int8")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("T", [1, 4, 12, 40])
@pytest.mark.parametrize("tiles", [True, False], ids=["vnni-tiles", "blas"])
def test_the_linear_op_reads_it_too(T, tiles, monkeypatch):
    """linear.cpu on every path: the GEMV (1, 4 tokens; 12 without VNNI), the tile GEMM (12, 40
    with it) and BLAS over dequantized blocks of rows (40 without: blocks of 16 rows, so a block
    is whole groups)."""
    monkeypatch.setattr(qgemm, "fast_here", lambda: tiles)
    rng = np.random.default_rng(3)
    w = random_blocks("q4_0", (96,), 256, rng)
    x = rng.standard_normal((T, 256)).astype(np.float32)
    want = linear.cpu(x, w, dots="int8")
    got = linear.cpu(x, interleave_ref(w), dots="int8")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(linear_quant.dequant_rows(interleave_ref(w), np.empty((96, 256), np.float32)),
                                  dequantize_ref(w))


def test_a_row_range_of_groups_is_whole_groups():
    w = interleave_ref(random_blocks("q4_0", (48,), 64, np.random.default_rng(5)))
    assert row_range(w, 16, 48).shape == (2, 2, 288) and row_range(w, 32, 48).shape == (1, 2, 288)
    for m0, m1 in ((8, 16), (0, 40)):
        with pytest.raises(ValueError, match="groups of 16"):
            row_range(w, m0, m1)
    with pytest.raises(ValueError, match="16 \\* groups"):
        linear_quant.dequant_rows(w, np.empty((40, 64), np.float32))


def test_fp32_dots_refuse_it_by_name():
    rng = np.random.default_rng(4)
    gu, dn = (interleave_ref(a) for a in _bank(rng))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="q4_0x16 .* int8 dots only"):
        experts.cpu(x, np.zeros((1, 3), np.int32), np.ones((1, 3), np.float32), gu, dn, dots="f32")
    w = interleave_ref(random_blocks("q4_0", (16,), 256, rng))
    with pytest.raises(ValueError, match="int8 dots only"):
        linear_quant.gemv(x, w, np.empty((1, 16), np.float32))
    with pytest.raises(ValueError, match="int8 dots only"):                  # many tokens: BLAS's path
        linear.cpu(np.ones((64, 256), np.float32), w, dots="f32")


_OTHER_TARGET = r"""
import numpy as np
from freetoken.kernels import _isa, _simd
from freetoken.kernels._numba import load_numba
from freetoken.kernels.qact import dequantize_ref as rounded_values, quantize
from freetoken.kernels.qformats import dequantize_ref, random_blocks
from freetoken.kernels.qlayout import interleave_ref
name, features = _isa.host()
assert name == "{cpu}" and _isa.int8_dot_path(features) == "{path}", (name, _isa.int8_dot_path(features))
assert ("f16c" in features) == {f16c}
@load_numba().njit                                       # plain numba: this source is no file
def dot(entries, xq, xd, xs, out):
    _simd.idot_q4_0x16(entries, xq, xd, xs, out)
@load_numba().njit
def unpack(entries, j, u, a, c):
    _simd.unpack_q4_0x16(entries, j, u, a, c)
rng = np.random.default_rng(2)
w = random_blocks("q4_0", (16,), 256, rng)
x = rng.standard_normal((1, 256)).astype(np.float32)
q, d, s = quantize(x)
out = np.zeros(16, np.float32)
dot(interleave_ref(w)[0], q.reshape(8, 32), d.reshape(8, 1), s.reshape(8, 1), out)
want = dequantize_ref(w) @ rounded_values(q, d)[0]
np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
u, a, c = np.zeros(8 * 32, np.uint8), np.zeros(8, np.float32), np.ones(8, np.float32)
unpack(interleave_ref(w)[0], 5, u, a, c)
np.testing.assert_array_equal((u.reshape(8, 32) * a[:, None] - 8 * a[:, None]).ravel(), dequantize_ref(w)[5])
assert (c == 0).all()
print("ok")
"""


HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+pclmul,+popcnt,+sse,+sse2,+sse3,+sse4.1,"
           "+sse4.2,+ssse3,+xsave")           # numba would add the host's own features to the name's


@pytest.mark.parametrize("cpu, features, path, f16c", [("haswell", HASWELL, "avx2", True), ("generic", "", "generic", False)])
def test_the_16_row_dot_on_a_cpu_without_vnni(cpu, features, path, f16c, tmp_path):
    """The AVX2 (pairwise multiply-adds) and portable paths, the latter with the fp16 scales read one
    at a time (no F16C), for a numba target of such a CPU in a fresh process: the engine interleaves
    only under VNNI, but the op is anyone's to call."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(tmp_path))
    if features:
        env["NUMBA_CPU_FEATURES"] = features
    child = _OTHER_TARGET.replace("{cpu}", cpu).replace("{path}", path).replace("{f16c}", str(f16c))
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
