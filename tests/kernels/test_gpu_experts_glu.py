"""experts.gpu with per-expert biases and gpt-oss's clamped SwiGLU (bias=, glu=) against ref on the
device: the decode GEMVs and the prefill GEMM tiles, bf16, fp32 and mxfp4 banks (gpt-oss's experts
as shipped) and q8_0, the clamps active (test_experts_glu's case: gate_up outputs near 5 against a
limit of 7), each keyword alone, a -1 id and a row routed nowhere; the scratch is poisoned so a
masked pair's row shows. The ops table's wrapper hands the keywords on."""
import numpy as np
import pytest

from freetoken.cupy_loader import cupy as load_cupy
from freetoken.kernels import experts
from tests.helpers import assert_close
from tests.kernels.test_experts_glu import GLU, SOFT, make_case
from tests.kernels.test_gpu_experts import poison_scratch

pytestmark = pytest.mark.gpu

KEYS = {"both": (True, GLU), "bias": (True, None), "glu": (False, GLU), "soft glu": (True, SOFT)}


def _device_run(x, ids, w, gate_up, down, bias, glu):
    cp = load_cupy()
    dev = [cp.asarray(a) for a in (x, ids, w, gate_up, down)]
    kw = {"bias": None if bias is None else tuple(cp.asarray(b) for b in bias), "glu": glu}
    out = cp.full(x.shape, np.nan, cp.float32)
    experts.gpu(*dev, out, **kw)                         # sizes the scratch
    poison_scratch()
    out.fill(np.nan)
    experts.gpu(*dev, out, **kw)
    return out.get()


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("kind", ["bf16", "f32", "mxfp4", "q8_0"])
def test_gpu_matches_ref(kind, T, keys):
    x, ids, w, gate_up, down, bias = make_case(np.random.default_rng(T + len(kind)), kind, T)
    with_bias, glu = KEYS[keys]
    bias = bias if with_bias else None
    want = experts.ref(x, ids, w, gate_up, down, bias=bias, glu=glu)
    got = _device_run(x, ids, w, gate_up, down, bias, glu)
    assert_close(f"experts gpu {kind} T{T} {keys}", want, got, 1e-4, 1e-3)
    if T > 2:
        np.testing.assert_array_equal(got[-1], 0.0)      # routed nowhere: no bias either


def test_the_cuda_ops_table_passes_the_keywords_on():
    from freetoken.backend import get_ops
    cp = load_cupy()
    x, ids, w, gate_up, down, bias = make_case(np.random.default_rng(4), "mxfp4", 3)
    got = get_ops("cuda").experts(x, ids, w, gate_up, down, bias=bias, glu=GLU)   # host biases moved too
    want = experts.ref(x, ids, w, gate_up, down, bias=bias, glu=GLU)
    assert_close("ops.experts", want, cp.asnumpy(got), 1e-4, 1e-3)
