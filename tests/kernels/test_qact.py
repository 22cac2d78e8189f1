"""kernels/qact.py: activations rounded to int8 per 32 values, and the int8 row dots that read them
(kernels/_simd_int8.py through qact.idot_row) against their spec, the dequantized row times the
rounded x; every instruction path this CPU can run gives the same integers."""
import numpy as np
import pytest
from test_qblocks import blocks

from freetoken.kernels import _simd, qact, qformats

INT8_FORMATS = [f.name for f in qformats.FORMATS if f.int8_dots]


def activations(rng, T, K):
    """Normal values with the cases the rounding has to get right: an all-zero group (scale 0), a
    group with one large value, exact .5 multiples of a scale, and both signs of the max."""
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, :32] = 0.0
    x[-1, 32:64] *= 1e-3
    x[-1, 40] = 300.0
    if K >= 128:
        x[0, 64:96] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)   # scale 1: ties at .5
        x[0, 95] = 127.0
        x[0, 96:128] = -x[0, 64:96]
    return x


@pytest.mark.parametrize("T", [1, 3, 17])              # 17: the parallel kernel
def test_quantize_is_bit_exact_with_the_spec(T):
    x = activations(np.random.default_rng(T), T, 256)
    got, want = qact.quantize(x), qact.quantize_ref(x)
    for name, g, w in zip("qds", got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.array_equal(g.view(np.uint8 if g.dtype == np.int8 else np.uint32),
                              w.view(np.uint8 if w.dtype == np.int8 else np.uint32)), name
    q, d, s = want
    assert np.abs(q).max() == 127 and (d[0, 0], s[0, 0]) == (0.0, 0.0)
    err = np.abs(qact.dequantize_ref(q, d) - x).reshape(T, -1, 32).max(axis=2)
    assert (err <= d / 2 * (1 + 1e-6)).all()              # round to nearest: half a step at most
    np.testing.assert_array_equal(qact.rounded(x), qact.rounded_ref(x))


@pytest.mark.parametrize("T", [1, 17])
def test_a_group_with_inf_or_nan_gets_the_specs_scale(T):
    """max|x| is taken on the bits: -inf's group gets d = inf and a NaN's group d = NaN, as in
    numpy; the other groups are untouched."""
    x = activations(np.random.default_rng(5), T, 128)
    x[-1, 33], x[-1, 70] = -np.inf, np.nan
    (q, d, _), (q_ref, d_ref, _) = qact.quantize(x), qact.quantize_ref(x)
    assert d[-1, 1] == np.inf and np.isnan(d[-1, 2]) and np.isnan(d_ref[-1, 2])
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_array_equal(q[:, :32], q_ref[:, :32])


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q6_k", "q4_0", "q2_k", "q3_k"])
def test_the_kernels_own_rounding_is_the_spec_in_blocks(name):
    """prepared(): what the GEMV kernels round inside themselves, bit for bit quantize_ref, in
    blocks of the weight's V values (the xs of q2_k, q3_k and q6_k: d times each 16 values' sum
    of q); without int8 only x (and empty arrays)."""
    fmt = qformats.format_named(name)
    values = fmt.values
    x = activations(np.random.default_rng(values), 3, 512)
    x_, q, d, s = qact.prepared(x, fmt.code, True)
    want = qact.quantize_ref(x)
    assert x_ is x or np.array_equal(x_, x)
    assert q.shape == (3, 512 // values, values) and d.shape == (3, 512 // values, values // 32)
    np.testing.assert_array_equal(q.reshape(3, -1), want[0])
    if name in ("q2_k", "q3_k", "q6_k"):
        sums = want[0].reshape(3, -1, 16).sum(axis=2, dtype=np.int32).astype(np.float32)
        want = want[:2] + ((np.repeat(want[1], 2, axis=1) * sums).astype(np.float32),)
    assert s.shape == (3, 512 // values, want[2].shape[1] * values // 512)
    for got, spec in ((d, want[1]), (s, want[2])):
        assert np.array_equal(got.reshape(3, -1).view(np.uint32), spec.view(np.uint32))
    assert [a.size for a in qact.prepared(x, fmt.code, False)[1:]] == [0, 0, 0]


def test_the_rounding_stays_exact_when_a_fastmath_kernel_compiles_it_first(tmp_path):
    """numba compiles a callee without its own fastmath setting with its caller's: a fresh cache,
    the int8 GEMV (fastmath) compiled before anything else, then the rounding checked bit for
    bit, inside the GEMV and called alone."""
    import subprocess
    import sys
    code = """
import numpy as np
from freetoken.kernels import linear_quant, qact, qformats
rng = np.random.default_rng(0)
w = qformats.random_blocks("q4_k", (8,), 256, rng)
x = (rng.standard_normal((3, 256)) * 3).astype(np.float32)
out = np.empty((3, 8), np.float32)
linear_quant.gemv(x, w, out, "int8")
want = qact.quantize_ref(x)
for got in (qact.quantize(x), qact.prepared(x, qformats.format_named("q4_k").code, True)[1:]):
    for g, s in zip(got, want):
        assert np.array_equal(g.reshape(s.shape).view(np.uint8), s.view(np.uint8)), (g, s)
print("exact")
"""
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "exact" in r.stdout, r.stderr[-3000:]


def test_a_row_that_is_not_groups_of_32_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        qact.quantize(np.zeros((1, 48), np.float32))


def test_wants_int8_only_for_the_formats_with_int8_dots():
    rng = np.random.default_rng(0)
    assert qact.wants_int8(blocks(rng, "q4_k", 2, 1), "int8")
    assert not qact.wants_int8(blocks(rng, "q4_k", 2, 1), "f32")
    assert qact.wants_int8(blocks(rng, "q4_0", 2, 1), "int8")          # every GGUF block format
    assert not qact.wants_int8(np.zeros((2, 1, 132), np.uint8), "int8")  # FreeToken's FP8 row blocks
    assert not qact.wants_int8(np.zeros((2, 32), np.uint16), "int8")     # bf16
    with pytest.raises(ValueError, match="dots must be one of"):
        qact.wants_int8(blocks(rng, "q4_k", 2, 1), "int4")


@pytest.mark.parametrize("name", INT8_FORMATS)
def test_int8_row_dots_match_the_spec(name):
    """Compiled idot_row (and the Python spec) against float64 dequantize_ref(w) @ rounded x,
    within 1e-5 of the sum of |w*x|: random bytes, so q8_0's -128 quants and every bit pattern
    of the packed fields occur."""
    fmt = qformats.format_named(name)
    rng = np.random.default_rng(40 + fmt.code)
    w = blocks(rng, name, 9, 11 if fmt.values == 32 else 3)     # 11: q8_0 eight blocks a step, then 3
    x = activations(rng, 2, w.shape[1] * fmt.values)
    q, d, s = qact.quantize(x)
    wf, xr = qformats.dequantize_ref(w).astype(np.float64), qact.rounded_ref(x).astype(np.float64)
    for t in range(2):
        want = wf @ xr[t]
        tol = 1e-5 * float((np.abs(wf) @ np.abs(xr[t])).max())
        got = [qact.idot_row(w[r], fmt.code, q[t], d[t], s[t]) for r in range(w.shape[0])]
        np.testing.assert_allclose(got, want, atol=tol, rtol=1e-5)
        spec = getattr(_simd, f"idot_{name}")
        np.testing.assert_allclose(spec(w[1], q[t], d[t], s[t]), want[1], rtol=1e-5)


def test_int8_row_dot_refuses_a_format_without_one():
    w = np.zeros((1, 132), np.uint8)                     # one fp8_b128 block: FreeToken's FP8 rows
    q, d, s = qact.quantize(np.ones((1, 128), np.float32))
    with pytest.raises(ValueError, match="no int8 dot"):
        qact.idot_row(w, qformats.format_named("fp8_b128").code, q[0], d[0], s[0])


def _paths_here():
    from freetoken.kernels._isa import host, int8_dot_path
    features = host()[1]
    paths = {"generic", int8_dot_path(features)}
    return sorted(paths | ({"avx2"} if "avx2" in features else set()))


@pytest.mark.parametrize("path", _paths_here())
def test_every_instruction_path_gives_the_same_integers(path):
    """The 8 lane sums of 32 unsigned x 32 signed bytes, as each path computes them, against
    numpy; at the ranges the dots use (u <= 128: q8_0's |q|; s in [-127, 127])."""
    from numba import njit, types
    from numba.extending import intrinsic

    from freetoken.kernels import _simd_int8
    ir = _simd_int8.ir

    @intrinsic
    def lanes(typingctx, u, s, out):
        def codegen(context, builder, sig, args):
            ua, sa, oa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
            load = [builder.load(builder.bitcast(a.data, _simd_int8.I8x32.as_pointer()), align=1) for a in (ua, sa)]
            acc = ir.Constant(_simd_int8.I32x8, [5, -7, 0, 1, 2, 3, 4, 1 << 20])
            lanes8 = _simd_int8.idot(builder, *load, acc, path)
            builder.store(lanes8, builder.bitcast(oa.data, _simd_int8.I32x8.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(u, s, out), codegen

    run = njit(lambda u, s, out: lanes(u, s, out))
    rng = np.random.default_rng(7)
    for u_max in (15, 63, 128):
        u = rng.integers(0, u_max + 1, 32).astype(np.uint8)
        s = rng.integers(-127, 128, 32).astype(np.int8)
        u[:4], s[:4] = u_max, 127                       # the largest pair sums
        out = np.zeros(8, np.int32)
        run(u, s, out)
        want = (u.astype(np.int32) * s.astype(np.int32)).reshape(8, 4).sum(axis=1)
        np.testing.assert_array_equal(out, want + [5, -7, 0, 1, 2, 3, 4, 1 << 20])


@pytest.mark.parametrize("path", _paths_here())
def test_every_instruction_path_gives_the_mxfp4_values(path):
    """The doubled e2m1 values of all 16 codes (twice, in both halves of the vector), as each path
    looks them up (vpshufb, or from the bits), against kernels/qmxfp4.py's table."""
    from numba import njit, types
    from numba.extending import intrinsic

    from freetoken.kernels import _simd_int8, qmxfp4
    I8x32 = _simd_int8.I8x32

    @intrinsic
    def values(typingctx, codes, out):
        def codegen(context, builder, sig, args):
            ca, oa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
            got = _simd_int8._kvalues(builder, builder.load(builder.bitcast(ca.data, I8x32.as_pointer()), align=1), path)
            builder.store(got, builder.bitcast(oa.data, I8x32.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.none(codes, out), codegen

    codes = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.uint8)
    out = np.zeros(32, np.int8)
    njit(lambda c, o: values(c, o))(codes, out)
    np.testing.assert_array_equal(out, qmxfp4.KVALUES[codes].astype(np.int8))
