"""kernels/_simd.py: the explicit-vector row dots against the spec (the row dequantized by
gguf-py, times x in float64), on contiguous and strided rows; q4_k, q5_k and q6_k:
test_qblocks.test_dots_match_ref. (Their Python bodies are the spec itself.)"""
import os

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
    qblocks.dot_rows.dispatcher                          # resolves the kernel and its sources
    names = {os.path.basename(p) for p in qblocks.dot_rows.sources}
    assert {"qblocks.py", "_numba.py", "_simd.py", "_simd_ir.py", "_simd_attn.py", "_isa.py"} <= names


@pytest.mark.parametrize("wanted", [True, False])
def test_prefetch_ahead_is_a_prefetch_of_the_row_ahead_and_nothing_else(monkeypatch, wanted):
    """prefetch_ahead compiles to llvm.prefetch for a C-contiguous array and for a strided one (the
    slots of pool.slot_views are), changes nothing, and may be asked for any row, the last ones
    and empty arrays included (it asks only for rows that exist). Where _isa.weight_prefetch says
    no (AMD Zen) it compiles to nothing."""
    from freetoken.kernels import _isa
    from freetoken.kernels._numba import SERIAL, njit
    monkeypatch.setattr(_isa, "weight_prefetch", lambda name=None: wanted)

    @njit(**{**SERIAL, "cache": False})           # cached code has no IR to look at
    def every_row(w):
        for r in range(w.shape[0] + 2):
            _simd.prefetch_ahead(w, r)
        return w.shape[0]

    rng = np.random.default_rng(2)
    for shape in [(0, 144), (1, 34), (7, 3, 210), (5000, 3)]:
        w = rng.integers(0, 256, shape, dtype=np.uint8)
        before = w.copy()
        assert every_row(w) == shape[0]
        np.testing.assert_array_equal(w, before)
    strided = w[::3]
    before = strided.copy()
    assert every_row(strided) == strided.shape[0]
    np.testing.assert_array_equal(strided, before)
    irs = every_row.dispatcher.inspect_llvm()
    by_layout = {sig[0].layout: ir for sig, ir in irs.items()}
    assert set(by_layout) == {"C", "A"} and all(("llvm.prefetch" in ir) == wanted for ir in by_layout.values())


def test_weight_prefetch_is_off_on_amd_zen_only():
    from freetoken.kernels import _isa
    assert not _isa.weight_prefetch("znver4") and not _isa.weight_prefetch("znver1")
    assert _isa.weight_prefetch("emeraldrapids") and _isa.weight_prefetch("generic")
    assert ("hardware prefetchers" in _isa.describe()) == (not _isa.weight_prefetch())


def test_prefetch_row_asks_for_that_row_only_when_it_exists():
    """prefetch_row (decode attention's KV records in slot order) compiles to llvm.prefetch, and a
    row past either end (the last records' lookahead) is a no-op, not a read."""
    from freetoken.kernels._numba import SERIAL, njit

    @njit(**{**SERIAL, "cache": False})
    def rows(w, which):
        for r in which:
            _simd.prefetch_row(w, r)
        return w.shape[0]

    w = np.random.default_rng(4).integers(0, 256, (9, 4, 64), dtype=np.uint8)
    before = w.copy()
    assert rows(w, np.array([-5, -1, 0, 8, 9, 1 << 40], np.int64)) == 9
    np.testing.assert_array_equal(w, before)
    assert "llvm.prefetch" in next(iter(rows.dispatcher.inspect_llvm().values()))
    _simd.prefetch_row(w, 3)                       # in Python: nothing


def test_decode_attention_asks_for_the_records_ahead():
    """attention_decode.chunk prefetches the KV records AHEAD slots on (docs/performance.md: 0.75-0.81x
    the time at 4,096 slots from memory, Xeon EMR VM): its compiled code calls llvm.prefetch."""
    from freetoken.kernels import attention_decode
    from freetoken.kernels._numba import load_numba
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((40, 2, 16)).astype(np.float32) for _ in range(2))
    out = np.empty((1, 4, 16), np.float32)
    attention_decode.run(rng.standard_normal((1, 4, 16)).astype(np.float32), k, v, np.arange(40, dtype=np.int32)[None],
                         np.zeros(1, np.int32), np.full(1, 39, np.int32), 0.25, out, 1)
    lazy = attention_decode.chunk
    numba = load_numba()
    fresh = numba.njit(**{**lazy.options, "cache": False})(lazy._resolved(numba))   # cached code has no IR
    for sig in lazy.dispatcher.signatures:
        fresh.compile(sig)
        assert "llvm.prefetch" in fresh.inspect_llvm(sig)


@pytest.mark.parametrize("half", ["scores", "rows"])
def test_decode_attention_blocks_ask_for_their_pieces_ahead(half):
    """Each block kernel of decode attention asks for its own kv group's piece of the records
    KV_AHEAD slots on as it runs (docs/performance.md, Xeon model-167 VM 2026-12-08: 0.77-0.83x
    the time at 16,384 shuffled slots of D 128): head_scores and weighted_v_rows alone compile to
    llvm.prefetch, and the hints change no result (their specs, slots near the end included)."""
    from freetoken.kernels._numba import SERIAL, njit
    rng = np.random.default_rng(6)
    q, p = (rng.standard_normal((2, 4, 64)).astype(np.float32) for _ in range(2))
    kv = (rng.standard_normal((12, 2, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    slots = rng.permutation(12).astype(np.int32)

    @njit(**{**SERIAL, "cache": False})
    def blocks(q, kv, slots, p, s, out):
        for j0 in range(0, slots.shape[0], 4):
            if half == "scores":
                _simd.head_scores(q, kv, slots, j0, 1, 0, np.float32(0.5), s)
            else:
                _simd.weighted_v_rows(p, kv, slots, j0, j0 + 4, 1, 0, 0, out)

    got = (np.zeros((2, 4, 12), np.float32), np.zeros((2, 4, 64), np.float32))
    want = tuple(x.copy() for x in got)
    blocks(q, kv, slots, p, *got)
    blocks.py_func(q, kv, slots, p, *want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert "llvm.prefetch" in next(iter(blocks.dispatcher.inspect_llvm().values()))


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("rep,D", [(4, 64), (1, 64), (3, 128), (6, 64), (8, 128)])
def test_weighted_v_rows_matches_its_spec(rep, D, dtype):
    """weighted_v_rows (decode attention's V half, sums in registers) against its Python body on
    every block of heads (4 a block, the last one short) and of D, a slot range that starts and
    ends inside the table, and records spaced wider than G x D (a view of a bigger pool)."""
    from freetoken.kernels._bf16 import from_f32
    from freetoken.kernels._numba import SERIAL, njit

    @njit(**{**SERIAL, "cache": False})
    def blocks(p, v, slots, j0, j1, out):
        for g in range(out.shape[0]):
            for r0 in range(0, out.shape[1], 4):
                for d0 in range(0, out.shape[2], _simd.V_BLOCK):
                    _simd.weighted_v_rows(p, v, slots, j0, j1, g, r0, d0, out)

    rng = np.random.default_rng(rep * D)
    G, N = 2, 50
    pool = rng.standard_normal((N, G + 1, D)).astype(np.float32)
    v = (from_f32(pool) if dtype == np.uint16 else pool)[:, 1:]
    slots = rng.permutation(N)[:37].astype(np.int32)
    p = rng.random((G, rep, 40)).astype(np.float32)
    start = rng.standard_normal((G, rep, D)).astype(np.float32)
    got, want = start.copy(), start.copy()
    blocks(p, v, slots, 3, 35, got)
    for g in range(G):
        for r0 in range(0, rep, 4):
            for d0 in range(0, D, _simd.V_BLOCK):
                _simd.weighted_v_rows(p, v, slots, 3, 35, g, r0, d0, want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, start)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("rep,D", [(4, 64), (8, 128), (4, 16), (4, 48)])
def test_head_scores_matches_its_spec(rep, D, dtype):
    """head_scores (decode attention's scores, 4 heads x 4 slots and one shuffle tree) against its
    Python body: every head block of every group, slot runs of 4 from an odd start, records spaced
    wider than G x D."""
    from freetoken.kernels._bf16 import from_f32
    from freetoken.kernels._numba import SERIAL, njit

    @njit(**{**SERIAL, "cache": False})
    def blocks(q, k, slots, scale, s):
        for j0 in range(1, slots.shape[0] - 3, 4):
            for g in range(q.shape[0]):
                for r0 in range(0, q.shape[1], 4):
                    _simd.head_scores(q, k, slots, j0, g, r0, scale, s)

    rng = np.random.default_rng(rep * D)
    G, N = 2, 50
    pool = rng.standard_normal((N, G + 1, D)).astype(np.float32)
    k = (from_f32(pool) if dtype == np.uint16 else pool)[:, 1:]
    slots = rng.permutation(N)[:22].astype(np.int32)
    q = rng.standard_normal((G, rep, D)).astype(np.float32)
    got, want = np.full((2, G, rep, 24), np.nan, np.float32)
    blocks(q, k, slots, np.float32(0.3), got)
    for j0 in range(1, 19, 4):
        for g in range(G):
            for r0 in range(0, rep, 4):
                _simd.head_scores(q, k, slots, j0, g, r0, np.float32(0.3), want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.isnan(got[..., 0]).all() and not np.isnan(got[..., 1:21]).any() and np.isnan(got[..., 21:]).all()


DECODE_GEMVS = ("linear_quant._gemv", "experts_quant._decode", "linear._gemv_pairs", "experts_pairs._gate_up_pairs",
                "experts_pairs._down_pairs", "experts_pairs._gate_up_words", "experts_pairs._down_words")


def test_the_decode_gemvs_ask_for_the_rows_ahead(tmp_path):
    """Every quantized and bf16 decode GEMV prefetches (docs/performance.md: a q4_k decode
    step ~25% faster on the Xeon EMR VM) where _isa.weight_prefetch allows it: its compiled code
    calls llvm.prefetch. In a fresh process with the hints forced on and its own numba cache, so
    the test holds on AMD Zen too (where the callees compiled here have no hints)."""
    import subprocess
    import sys
    from pathlib import Path
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_simd; "
              "from freetoken.kernels import _isa; _isa.weight_prefetch = lambda name=None: True; "
              "print([k for k in test_simd.DECODE_GEMVS if not test_simd.prefetches(k)])")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def prefetches(kernel: str) -> bool:
    """Whether `kernel` (module.name), run through the ops so it compiles with the types the engine
    gives it, calls llvm.prefetch in every signature."""
    import importlib
    from freetoken.backend import get_ops
    from freetoken.kernels._numba import load_numba
    module, name = kernel.split(".")
    lazy = getattr(importlib.import_module(f"freetoken.kernels.{module}"), name)
    compiled = lazy.dispatcher
    rng = np.random.default_rng(3)
    ops = get_ops("cpu", cpu_dots="int8")
    x = rng.standard_normal((1, 256)).astype(np.float32)
    if module == "linear_quant":
        from freetoken.kernels.qformats import random_blocks
        ops.linear(x, random_blocks("q4_k", (64,), 256, rng))
    elif module == "linear":
        ops.linear(x, (rng.standard_normal((64, 256)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    else:
        ids, weights = np.array([[0, 2]], np.int32), np.array([[0.5, 0.5]], np.float32)
        if module == "experts_quant":
            from freetoken.kernels.qformats import random_blocks
            gate_up, down = random_blocks("q4_k", (4, 512), 256, rng), random_blocks("q4_k", (4, 256), 256, rng)
        else:
            bits = lambda *s: (rng.standard_normal(s).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
            gate_up, down = bits(4, 512, 256), bits(4, 256, 256)
        ops.experts(x, ids, weights, gate_up, down)
    assert compiled.overloads, f"{kernel} did not run"
    numba = load_numba()
    fresh = numba.njit(**{**lazy.options, "cache": False})(lazy._resolved(numba))   # cached code has no IR
    for sig in compiled.signatures:
        fresh.compile(sig)
    return all("llvm.prefetch" in fresh.inspect_llvm(sig) for sig in compiled.signatures)
