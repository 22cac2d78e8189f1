"""kernels/_simd.py: the explicit-vector row dots against the spec (the row dequantized by
gguf-py, times x in float64), on contiguous and strided rows; q4_k, q5_k and q6_k:
test_qblocks.test_dots_match_ref. (Their Python bodies are the spec itself.)"""
import gguf
import numpy as np
import pytest

from freetoken.kernels import _simd, qblocks
from freetoken.kernels.qformats import format_of


def q8_0_rows(rng, R, K, scale=0.05):
    w = (rng.standard_normal((R, K)) * scale).astype(np.float32)
    w[0, :32] = 0.0                                   # an all-zero block (d = 0)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(R, K // 32, 34)
    exact = gguf.quants.dequantize(raw.reshape(R, -1), gguf.GGMLQuantizationType.Q8_0).reshape(R, K)
    return raw, exact


@pytest.mark.parametrize("K", [32, 96, 1024, 4096 + 32])
def test_q8_0_vector_dot_matches_the_spec(K):
    rng = np.random.default_rng(K)
    raw, exact = q8_0_rows(rng, 9, K)
    x = rng.standard_normal(K).astype(np.float32)
    want = exact.astype(np.float64) @ x.astype(np.float64)
    got = np.empty(9, np.float32)
    qblocks.dot_rows(raw, format_of(raw).code, x, got)              # compiled: the vector code
    scale = np.abs(exact).max() * np.abs(x).sum()
    np.testing.assert_allclose(got, want, atol=3e-6 * scale, rtol=0)


def test_q8_0_strided_row_takes_a_contiguous_copy():
    """A row view with a gap between blocks (not C-contiguous) gives the same dot."""
    from freetoken.kernels._numba import SERIAL, njit
    rng = np.random.default_rng(1)
    raw, exact = q8_0_rows(rng, 1, 256)
    padded = np.zeros((8, 40), np.uint8)
    padded[:, :34] = raw[0]
    x = rng.standard_normal(256).astype(np.float32)

    @njit(**SERIAL)
    def dot(row, xv):
        return _simd.dot_q8_0(row, xv)
    got = dot(padded[:, :34], x.reshape(8, 32))
    np.testing.assert_allclose(got, exact[0].astype(np.float64) @ x, rtol=1e-5)


def test_an_edit_to_the_vector_code_recompiles_the_kernels_that_inline_it():
    """numba's cache checks only a kernel's own file; the vector IR is inlined through overloads,
    so its files are part of every kernel's cache stamp (kernels/_numba.py)."""
    import os
    qblocks.dot_rows.dispatcher                          # resolves the kernel and its sources
    names = {os.path.basename(p) for p in qblocks.dot_rows.sources}
    assert {"qblocks.py", "_numba.py", "_simd.py", "_simd_ir.py"} <= names
