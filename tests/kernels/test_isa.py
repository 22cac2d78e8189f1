"""kernels/_isa.py: the kernels choose their instructions from numba's target, not the host's
CPUID, so a cache built for another target (NUMBA_CPU_NAME=generic: a portable cache, no AVX)
compiles and runs instead of aborting in LLVM (inline vdpbf16ps asm; fp16 widened by a library
call numba's JIT does not link)."""
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
x = rng.standard_normal((1, 64)).astype(np.float32)
q, d, s = qact.quantize(x)
row = np.zeros((2, 34), np.uint8)
row[:, 0:2] = np.frombuffer(np.array([0.5, 2.0 ** -20], np.float16).tobytes(), np.uint8).reshape(2, 2)  # a subnormal d too
row[:, 2:] = rng.integers(0, 256, (2, 32), dtype=np.uint8)
got = qact.idot_row(row, qformats.format_named("q8_0").code, q[0], d[0], s[0])
want = qformats.dequantize_ref(row) @ qact.rounded_ref(x)[0]
assert abs(got - want) <= 1e-5 * (1 + abs(want)), (got, want)
print("ok")
"""


def test_a_generic_numba_target_takes_the_portable_paths(tmp_path):
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
