"""kernels/qgemm.py: the int8 tile GEMM of quantized weights (kernels/_simd_igemm.py) against its
spec, the dequantized weights times the rounded activations, for every format it reads, through
the grouped entry the experts use and on every vnni width this CPU can compile."""
import numpy as np
import pytest
from test_qact import activations
from test_qblocks import blocks

from freetoken.kernels import _simd, qact, qformats, qgemm

NAMES = [f.name for f in qformats.FORMATS if f.code in qgemm.GROUPS]     # every format the tile GEMM reads


def _bank(rng, name, S, M, K):
    fmt = qformats.format_named(name)
    return np.stack([blocks(rng, name, M, K // fmt.values) for _ in range(S)])


def _want(w, x, uniq, offs, rows):
    """float64 spec: [P, M], pair p of group u = dequantized w[uniq[u]] . rounded x[rows[p]]."""
    xr = qact.rounded_ref(x).astype(np.float64)
    want, scale = np.empty((rows.shape[0], w.shape[1])), np.empty((rows.shape[0], w.shape[1]))
    for u, e in enumerate(uniq):
        wf = qformats.dequantize_ref(w[e]).astype(np.float64)
        for p in range(offs[u], offs[u + 1]):
            want[p], scale[p] = wf @ xr[rows[p]], np.abs(wf) @ np.abs(xr[rows[p]])
    return want, scale


@pytest.mark.parametrize("name", NAMES)
def test_grouped_tile_gemm_matches_the_spec(name):
    """Three slots, two used, 85 and 17 tokens (six tiles, the last ragged; a full tile and a
    ragged one; tokens taken out of order, one twice), both output layouts; random bytes, so
    every packed bit pattern occurs."""
    rng = np.random.default_rng(7 + len(name))
    K = 512 if name != "q8_0" else 96
    w, x = _bank(rng, name, 3, 37, K), activations(rng, 90, K)
    uniq, offs = np.array([2, 0], np.int32), np.array([0, 85, 102], np.int32)
    rows = np.concatenate([rng.permutation(90)[:85], rng.permutation(90)[:16], [3]]).astype(np.int32)
    q, d, _ = qact.quantize(x)
    src, first = qgemm.lane_sources(offs, rows)
    t = qgemm.tiles(q, d, src, qformats.format_of(w).code)
    want, scale = _want(w, x, uniq, offs, rows)
    got = qgemm.gemm(w, t, uniq, offs, first, np.full((102, 37), np.nan, np.float32), False)
    np.testing.assert_allclose(got, want, atol=2e-6 * scale.max(), rtol=1e-5)
    got_t = qgemm.gemm(w, t, uniq, offs, first, np.full((37, 102), np.nan, np.float32), True)
    np.testing.assert_array_equal(got_t, got.T)
    pw = rng.uniform(0.1, 1.0, 102).astype(np.float32)
    assert_added(qgemm.gemm(w, t, uniq, offs, first, np.ones((90, 37), np.float32), False, (rows, pw)), got, rows, pw)
    assert_gated(qgemm.gemm(w, t, uniq, offs, first, np.full((102, 18), np.nan, np.float32), False, swiglu=True), got)


def assert_gated(gated, got):
    """swiglu's result: silu(row m's product) * row half + m's, for the first half of the rows
    (an odd M's last row unused)."""
    half = gated.shape[1]
    g = got[:, :half].astype(np.float64)
    want = g / (1 + np.exp(-g)) * got[:, half:2 * half]
    np.testing.assert_allclose(gated, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


def assert_added(added, got, rows, pw):
    """add_to's result: 1 + each pair's product weighted, summed at its token's row (token 3
    twice, tokens not taken keep their 1)."""
    want = np.ones_like(added)
    np.add.at(want, rows, pw[:, None] * got)
    np.testing.assert_allclose(added, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _unpacked(w, fmt):
    """Rows of w unpacked by the compiled unpack_* (u, a, c)."""
    code, G = fmt.code, qgemm.GROUPS[fmt.code][0]
    K = w.shape[1] * fmt.values
    un = (np.zeros((w.shape[0], K), np.uint8), np.zeros((w.shape[0], K // G), np.float32),
          np.zeros((w.shape[0], K // G), np.float32))
    for j in range(w.shape[0]):
        qgemm._unpack(w, j, code, un[0][j], un[1][j], un[2][j])
    return un


@pytest.mark.parametrize("name", NAMES)
def test_unpacked_rows_give_the_dequantized_values(name):
    """a * (u - off) - c per group of G values is the row's spec (gguf-py's dequantize), every bit
    pattern of random blocks; no mins: c = 0."""
    rng = np.random.default_rng(4)
    fmt = qformats.format_named(name)
    w = blocks(rng, name, 3, 2 if fmt.values == 256 else 8)
    G, off = qgemm.GROUPS[fmt.code]
    u, a, c = _unpacked(w, fmt)
    got = ((u.astype(np.float64) - off).reshape(3, -1, G) * a[:, :, None] - c[:, :, None]).reshape(3, -1)
    want = np.stack([qformats.dequantize_ref(row) for row in w]).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())
    assert (c == 0).all() == (fmt.code not in qgemm.MINS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("pair", [2, 1])
def test_the_python_spec_of_the_products_agrees(name, pair):
    """_simd.igemm_g* run as Python (float64 sums of the unpacked rows) give the compiled numbers,
    4 rows against 2 tiles or 1 (the second tile's 4 tokens and the first's 16)."""
    rng = np.random.default_rng(3)
    fmt = qformats.format_named(name)
    w = blocks(rng, name, 6, 2 if fmt.values == 256 else 8)
    x = activations(rng, 20, w.shape[1] * fmt.values)
    q, d, _ = qact.quantize(x)
    src, _ = qgemm.lane_sources(np.array([0, 20]), np.arange(20, dtype=np.int32))
    t = qgemm.tiles(q, d, src, fmt.code)
    un = _unpacked(w, fmt)
    has_min = int(fmt.code in qgemm.MINS)
    spec, got = np.zeros((4 * pair, 16)), np.zeros((4 * pair, 16), np.float32)
    getattr(_simd, f"igemm_g{qgemm.GROUPS[fmt.code][0]}")(*un, *t, 2, 2 - pair, has_min, spec)
    qgemm._igemm(qgemm.kind_of(fmt.code), un, t, 2, 2 - pair, got)
    np.testing.assert_allclose(got, spec, rtol=2e-5, atol=1e-5 * np.abs(spec).max())


def test_tiles_lay_tokens_out_four_values_a_lane():
    q = np.arange(2 * 64, dtype=np.int64).reshape(2, 64).astype(np.int8)
    d = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    src = np.full(16, -1, np.int32)
    src[:3] = [1, 0, 1]
    xt, xd, xs, xb = qgemm.tiles(q, d, src, qformats.format_named("q8_0").code)
    assert xt.shape == (1, 16, 16, 4)
    np.testing.assert_array_equal(xt[0, 5, 0], q[1, 20:24])
    np.testing.assert_array_equal(xt[0, 5, 1], q[0, 20:24])
    assert not xt[0, :, 3:].any() and not xd[0, :, 3:].any()
    np.testing.assert_array_equal(xd[0, :, 2], d[1])
    assert xb[0, 1, 1] == -128 * int(q[0, 32:].astype(np.int32).sum())
    assert xs[0, 1, 1] == np.float32(2.0) * np.float32(q[0, 32:].astype(np.int32).sum())


def _paths_here():
    from freetoken.kernels._isa import host, int8_tile_path
    here = int8_tile_path(host()[1])
    return sorted({"generic", here} | ({"vnni"} if here == "vnni512" else set()))


@pytest.mark.parametrize("path", _paths_here())
def test_every_vnni_width_gives_the_same_integers(path):
    """The 16 lane sums of one step (4 unsigned bytes in every lane against 64 signed ones) as each
    path computes them, at the extremes the formats reach (u up to 255: q8_0's q + 128)."""
    from numba import njit, types
    from numba.extending import intrinsic

    from freetoken.kernels import _simd_itile as it

    @intrinsic
    def lanes(typingctx, u, s, out):
        def codegen(context, builder, sig, args):
            ua, sa, oa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
            u4 = builder.load(builder.bitcast(ua.data, it.ir.VectorType(it.I8, 32).as_pointer()), align=1)
            x = builder.load(builder.bitcast(sa.data, it.I8x64.as_pointer()), align=1)
            acc = it.ir.Constant(it.I32x16, list(range(-8, 8)))
            word3 = it._lanes(builder, builder.bitcast(u4, it.ir.VectorType(it.I32, 8)), [3] * 16)
            sums = it._vnni16(builder, acc, builder.bitcast(word3, it.I8x64), x, path)
            builder.store(sums, builder.bitcast(oa.data, it.I32x16.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(u, s, out), codegen

    run = njit(lambda u, s, out: lanes(u, s, out))
    rng = np.random.default_rng(5)
    u = rng.integers(0, 256, 32).astype(np.uint8)
    u[12:16] = 255
    s = rng.integers(-127, 128, 64).astype(np.int8)
    s[:4] = 127
    s[4:8] = -127
    out = np.zeros(16, np.int32)
    run(u, s, out)
    want = (u[12:16].astype(np.int32)[None, :] * s.astype(np.int32).reshape(16, 4)).sum(axis=1)
    np.testing.assert_array_equal(out, want + np.arange(-8, 8))
