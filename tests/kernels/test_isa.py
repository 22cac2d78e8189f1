"""kernels/_isa.py: the kernels choose their instructions from numba's target, not the host's
CPUID, so a cache built for another target (NUMBA_CPU_NAME=generic: a portable cache, no AVX)
compiles and runs instead of aborting in LLVM (inline vdpbf16ps asm; fp16 widened by a library
call numba's JIT does not link; decode attention's vector IR lowered without AVX; bf16 decode
row dots without vdpbf16ps)."""
import os
import subprocess
import sys

_CHILD = r"""
import numpy as np
from freetoken.kernels import _isa, experts_bf16, qact, qformats
name, features = _isa.host()
assert name == "generic" and "avx2" not in features and "avx512f" not in features, (name, sorted(features)[:8])
assert not _isa.bf16_dots() and _isa.int8_dot_path(features) == "generic"
assert "SSE" in _isa.describe() and "widened to fp32" in _isa.describe()
rows = np.zeros((4, 8), np.uint32)
assert not experts_bf16.runs_here(rows, rows)
rng = np.random.default_rng(0)
for name, K in (("q8_0", 320), ("q4_k", 512), ("q6_k", 512), ("mxfp4", 512), ("q4_0", 320), ("q5_1", 96),
                ("q2_k", 256), ("q3_k", 512)):                      # q8_0, q4_0: 8 blocks a step, 2 after
    x = rng.standard_normal((1, K)).astype(np.float32)
    row = qformats.random_blocks(name, (), K, rng)
    if name == "q8_0":
        row[3, 0:2] = np.frombuffer(np.float16(2.0 ** -20).tobytes(), np.uint8)     # a subnormal d
    code = qformats.format_named(name).code
    q, d, s = qact.quantize(x)
    got = qact.idot_row(row, code, q[0], d[0], s[0])
    want = qformats.dequantize_ref(row) @ qact.rounded_ref(x)[0]
    scale = np.abs(qformats.dequantize_ref(row)) @ np.abs(qact.rounded_ref(x)[0])
    assert abs(got - want) <= 1e-5 * scale, (name, got, want)
from freetoken.kernels import _simd, experts             # bf16 decode rows widened to fp32 (no vdpbf16ps)
from freetoken.kernels._bf16 import from_f32
from freetoken.kernels._numba import load_numba
w, xw = (from_f32(rng.standard_normal(n).astype(np.float32)).view(np.uint32) for n in ((5, 40), 40))
@load_numba().njit                                       # plain numba: this source is no file
def rows4(w, xw):
    return _simd.bdot_rows4(w, xw, 4, 0, 2, 2)
np.testing.assert_allclose(rows4(w, xw), _simd.bdot_rows4(w, xw, 4, 0, 2, 2), rtol=1e-5, atol=1e-5)
gate_up = from_f32(rng.standard_normal((4, 80, 96)).astype(np.float32) / 10)
down = from_f32(rng.standard_normal((4, 96, 40)).astype(np.float32) / 7)
x, ids, w = rng.standard_normal((1, 96)).astype(np.float32), np.array([[0, 3]], np.int32), np.ones((1, 2), np.float32)
np.testing.assert_allclose(experts.cpu(x, ids, w, gate_up, down, bf16=True),
                           experts.ref(x, ids, w, gate_up, down, bf16=True), atol=1e-4, rtol=1e-4)
from freetoken.kernels import attention                  # decode's scores and V rows as vector IR
k, v = (from_f32(rng.standard_normal((300, 2, 64)).astype(np.float32)) for _ in range(2))
args = (rng.standard_normal((1, 8, 64)).astype(np.float32), k, v, rng.permutation(300).astype(np.int32)[None],
        np.zeros(1, np.int32), np.array([299], np.int32), 0.125)
np.testing.assert_allclose(attention.cpu(*args), attention.ref(*args), atol=2e-5, rtol=1e-4)
print("ok")
"""


def test_a_generic_numba_target_takes_the_portable_paths(tmp_path):
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
