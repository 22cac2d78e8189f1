"""kernels/qgemm_amx.py, the quantized GEMM on AMX-INT8 tiles, against the same spec as the VNNI
kernel and against that kernel itself, for every format it reads (mxfp4 stays on VNNI) and both output layouts; skipped on a
CPU without AMX-INT8 (or where Linux does not grant the tiles)."""
import numpy as np
import pytest
from test_qgemm import NAMES, _bank, _want, assert_added, assert_gated
from test_qact import activations

from freetoken.kernels import _isa, qact, qformats, qgemm

pytestmark = pytest.mark.skipif(not _isa.amx_int8(), reason="no AMX-INT8 tiles on this CPU")


@pytest.mark.parametrize("name", [n for n in NAMES if qformats.format_named(n).code in qgemm.AMX_CODES])
@pytest.mark.parametrize("M", [37, 16, 5])
def test_amx_gemm_matches_the_spec_and_the_vnni_kernel(name, M):
    """Three slots, two used, 85 and 17 tokens (the last tile ragged; tokens out of order, one
    twice); M = 37 leaves a row block of 5, M = 5 is one."""
    from freetoken.kernels import qgemm_amx
    rng = np.random.default_rng(11 + M + len(name))
    K = 512 if name != "q8_0" else 96
    w, x = _bank(rng, name, 3, M, K), activations(rng, 90, K)
    uniq, offs = np.array([2, 0], np.int32), np.array([0, 85, 102], np.int32)
    rows = np.concatenate([rng.permutation(90)[:85], rng.permutation(90)[:16], [3]]).astype(np.int32)
    q, d, _ = qact.quantize(x)
    src, first = qgemm.lane_sources(offs, rows)
    code = qformats.format_of(w).code
    t = qgemm.tiles(q, d, src, code)
    want, scale = _want(w, x, uniq, offs, rows)
    got = qgemm_amx.gemm(w, code, qgemm.GROUPS[code][0], t, uniq, offs, first, np.full((102, M), np.nan, np.float32), qgemm.into(False))
    np.testing.assert_allclose(got, want, atol=2e-6 * scale.max(), rtol=1e-5)
    got_t = qgemm_amx.gemm(w, code, qgemm.GROUPS[code][0], t, uniq, offs, first, np.full((M, 102), np.nan, np.float32), qgemm.into(True))
    np.testing.assert_array_equal(got_t, got.T)
    vnni = np.full((102, M), np.nan, np.float32)
    qgemm.vnni(w, code, t, uniq, offs, first, vnni, qgemm.into(False))
    np.testing.assert_allclose(got, vnni, atol=1e-6 * scale.max(), rtol=1e-6)
    pw = rng.uniform(0.1, 1.0, 102).astype(np.float32)
    added = qgemm_amx.gemm(w, code, qgemm.GROUPS[code][0], t, uniq, offs, first, np.ones((90, M), np.float32),
                           qgemm.into(False, (rows, pw)))
    assert_added(added, got, rows, pw)
    gated = qgemm_amx.gemm(w, code, qgemm.GROUPS[code][0], t, uniq, offs, first, np.full((102, M // 2), np.nan, np.float32),
                           qgemm.into(False, None, M // 2))
    assert_gated(gated, got)
