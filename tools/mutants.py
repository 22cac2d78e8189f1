"""The emulated GPU suite against defects put into the tree one at a time: a mutation catalogue of
the kinds of GPU bug the emulator exists to catch (barriers, stream waits, bounds, alignment,
argument order, launch limits, numerics, memory). Run by hand or nightly, not in every CI run:

    python tools/mutants.py [--only NAME,...] [--list] [--out bench/results/mutants.json]

Each mutant replaces one exact text of one file in a scratch copy of the working tree and runs
the tests that should catch it on the emulated device (FREETOKEN_CUDA_EMULATE=1; race mode and
schedule fuzz where the mutant says so). Caught: the tests fail; missed: they pass. A table, the
score, and JSON with each mutant's first error line. docs/debugging.md records the score.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_KERNELS = "tests/kernels/test_gpu_{}.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    kind: str          # barrier, stream, bounds, alignment, arguments, limits, numerics, memory
    path: str          # the file changed, from the repo root
    old: str           # exact text, present once
    new: str
    tests: tuple[str, ...]
    races: bool = False  # race mode (and schedule fuzz) on


MOE = ("tests/moe/test_gpu_moe.py", "tests/moe/test_moe_runtime.py", "tests/moe/test_moe_runtime_staged.py")


def k(*names):
    return tuple(GPU_KERNELS.format(n) for n in names)


MUTANTS = (
    # -- barriers: shared memory reused with no __syncthreads between (race mode) -----------------
    Mutant("block_sum without its trailing barrier", "barrier", "cuda/common.cuh",
           "    for (int w = 0; w < (int)(blockDim.x / WARP); ++w) r += scratch[w];\n    __syncthreads();\n    return r;\n}\n\n__device__ __forceinline__ int",
           "    for (int w = 0; w < (int)(blockDim.x / WARP); ++w) r += scratch[w];\n    return r;\n}\n\n__device__ __forceinline__ int",
           k("rms_norm", "router", "sampling", "logprobs"), races=True),
    Mutant("block_max without its trailing barrier", "barrier", "cuda/common.cuh",
           "r = fmaxf(r, scratch[w]);\n    __syncthreads();", "r = fmaxf(r, scratch[w]);",
           k("router", "sampling"), races=True),
    Mutant("block_argmax without its trailing barrier", "barrier", "cuda/common.cuh",
           "r = better(r, scratch[w]);\n    __syncthreads();", "r = better(r, scratch[w]);",
           k("logprobs", "sampling"), races=True),
    Mutant("block_sum publishes before the barrier is reached", "barrier", "cuda/common.cuh",
           "    if (lane == 0) scratch[warp] = v;\n    __syncthreads();\n    float r = 0.0f;",
           "    if (lane == 0) scratch[warp] = v;\n    float r = 0.0f;", k("rms_norm"), races=True),
    Mutant("prefill attention reads keys before they are all staged", "barrier", "cuda/attention.cu",
           "sk[d * (KEY_TILE + 1) + jj] = ok ? to_f32(kc[((size_t)s_slot[jj] * G + g) * D + d]) : 0.f;\n  }\n  __syncthreads();",
           "sk[d * (KEY_TILE + 1) + jj] = ok ? to_f32(kc[((size_t)s_slot[jj] * G + g) * D + d]) : 0.f;\n  }",
           k("attention"), races=True),
    Mutant("gdn_rule sums partials before every warp wrote its own", "barrier", "cuda/gdn_rule.cu",
           "        sh.part_u[warp][lane] = pu;\n        __syncthreads();", "        sh.part_u[warp][lane] = pu;",
           k("gdn_rule"), races=True),
    Mutant("linear GEMM reads its row table before it is written", "barrier", "cuda/linear_impl.cuh",
           "  if (r < TILE_T) srow[r] = t0 + r < T ? t0 + r : -1;\n  __syncthreads();",
           "  if (r < TILE_T) srow[r] = t0 + r < T ? t0 + r : -1;", k("linear"), races=True),
    Mutant("router: the taken mark races the next pass", "barrier", "cuda/router.cu",
           "            smem_p[best.i] = TAKEN;\n        }\n        __syncthreads();",
           "            smem_p[best.i] = TAKEN;\n        }", k("router"), races=True),
    Mutant("expert plan scan without its middle barrier", "barrier", "cuda/experts.cu",
           "tid >= off ? s_til[tid - off] : 0;\n    __syncthreads();", "tid >= off ? s_til[tid - off] : 0;",
           k("experts"), races=True),
    Mutant("expert GEMM stages rows before the row table is written", "barrier", "cuda/experts_impl.cuh",
           "(GATE_UP ? perm[r0 + tid] / k : r0 + tid);\n    __syncthreads();",
           "(GATE_UP ? perm[r0 + tid] / k : r0 + tid);", k("experts"), races=True),
    Mutant("linear GEMM tile overwritten while read", "barrier", "cuda/gemv_common.cuh",
           "          for (int j = 0; j < 4; ++j) acc[n][i][j] += a[i] * b[j];\n      }\n    }\n    __syncthreads();",
           "          for (int j = 0; j < 4; ++j) acc[n][i][j] += a[i] * b[j];\n      }\n    }",
           k("linear", "experts"), races=True),
    Mutant("decode attention scores read before the query is staged", "barrier", "cuda/attention.cu",
           "  for (int j = threadIdx.x; j < len; j += ATT_THREADS) sslot[j] = row[j];\n  __syncthreads();",
           "  for (int j = threadIdx.x; j < len; j += ATT_THREADS) sslot[j] = row[j];",
           k("attention"), races=True),
    # -- stream waits (cross-stream hazards) --------------------------------------------------------
    Mutant("prefill copy stream does not wait for the buffer's release", "stream", "freetoken/moe/prefill.py",
           "        self.dev.wait(self._release[b], on_copy=True)   # the layer that read this buffer is done\n", "",
           MOE),
    Mutant("prefill compute does not wait for its buffer's load", "stream", "freetoken/moe/prefill.py",
           "        self.dev.wait(self._ready[b])\n", "", MOE),
    Mutant("decode fill does not wait for the residency plan", "stream", "freetoken/moe/runtime.py",
           "        dev.wait(self._planned, on_copy=True)\n", "", MOE),
    Mutant("decode compute does not wait for the fill", "stream", "freetoken/moe/runtime.py",
           "        dev.wait(self._filled)\n", "", MOE),
    Mutant("a new prefill's copies do not wait for the invalidation", "stream", "freetoken/moe/prefill.py",
           "        self.dev.wait(self._begin_ev, on_copy=True)\n", "", MOE),
    # -- bounds ---------------------------------------------------------------------------------------
    Mutant("router reads one logit past the row", "bounds", "cuda/router.cu",
           "for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, x[e]);",
           "for (int e = threadIdx.x; e <= E; e += blockDim.x) m = fmaxf(m, x[e]);", k("router")),
    Mutant("kv_write accepts slot N", "bounds", "cuda/kv_write.cu",
           "if (s < 0 || s >= N) return;", "if (s < 0 || s > N) return;", k("kv_write")),
    Mutant("router writes one probability before the buffer", "memory", "cuda/router.cu",
           "            smem_p[best.i] = TAKEN;", "            smem_p[best.i - 1] = TAKEN;", k("router")),
    Mutant("embedding reads row V", "bounds", "cuda/embedding.cu",
           "if (id < 0 || id >= V) {", "if (id < 0 || id > V) {", k("embedding")),
    Mutant("kv_write writes one value past its row", "memory", "cuda/kv_write.cu",
           "for (int j = threadIdx.x; j < GD; j += blockDim.x) {",
           "for (int j = threadIdx.x; j <= GD; j += blockDim.x) {", k("kv_write")),
    # -- alignment ------------------------------------------------------------------------------------
    Mutant("GEMV vector loads without the alignment check", "alignment", "cuda/gemv_common.cuh",
           "  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;", "  return true;",
           k("linear", "experts")),
    Mutant("decode attention vector loads without the alignment check", "alignment", "cuda/attention.cu",
           "  const bool vec = (D & 7) == 0 && aligned16(kc);", "  const bool vec = (D & 7) == 0;",
           k("attention")),
    # -- argument order -------------------------------------------------------------------------------
    Mutant("router: T and E swapped in the wrapper's launch order", "arguments", "freetoken/kernels/router.py",
           '"weights:f32*", "T:i32", "E:i32", "k:i32",', '"weights:f32*", "E:i32", "T:i32", "k:i32",',
           k("router") + ("tests/kernels/test_signatures.py",)),
    Mutant("gdn_rule: Hk and Hv swapped in the kernel's signature", "arguments", "cuda/gdn_rule.cu",
           "float* out, int Hk, int Hv, int Dk,", "float* out, int Hv, int Hk, int Dk,",
           k("gdn_rule") + ("tests/kernels/test_signatures.py",)),
    # -- launch limits ----------------------------------------------------------------------------------
    Mutant("router.MAX_E forgets the static shared memory", "limits", "freetoken/kernels/router.py",
           "MAX_E = (48 * 1024 - 640) // 4", "MAX_E = 48 * 1024 // 4", k("router")),
    Mutant("gdn_rule takes Dk up to 512 again", "limits", "freetoken/kernels/gdn_rule.py",
           "    return device_limits.max_threads(\"gdn_rule_f32\") // 32 * ROWS_PER_THREAD",
           "    return 32 * ROWS_PER_THREAD", k("gdn_rule")),
    Mutant("linear launches its GEMVs at 1024 threads", "limits", "freetoken/kernels/linear.py",
           "(128 if gemv else 256,)", "(1024 if gemv else 256,)", k("linear", "quant")),
    # -- numerics ---------------------------------------------------------------------------------------
    Mutant("router drops NaN rows again", "numerics", "cuda/router.cu",
           "if (p != TAKEN) best = better(best, ArgMax{isnan(p) ? NAN_RANK : p, e});",
           "if (p >= 0.0f) best = better(best, ArgMax{p, e});", k("router")),
    Mutant("rms_norm without its epsilon", "numerics", "cuda/rms_norm.cu",
           "sqrtf(ss / (float)H + eps)", "sqrtf(ss / (float)H)", k("rms_norm")),
    Mutant("softmax without the max subtracted", "numerics", "cuda/router.cu",
           "smem_p[e] = expf(x[e] - m);", "smem_p[e] = expf(x[e]);", k("router")),
    Mutant("router renormalises over E, not k", "numerics", "cuda/router.cu",
           "weights[(long long)t * k + j] = norm ? smem_w[j] / total : smem_w[j];",
           "weights[(long long)t * k + j] = smem_w[j];", k("router")),
    Mutant("sampling ignores the temperature", "numerics", "cuda/sampling.cu",
           "Row r = {z, V, 1.0f / temp, neg_inf()};", "Row r = {z, V, 1.0f, neg_inf()};", k("sampling")),
    Mutant("decode attention shifts an all -inf chunk by -inf", "numerics", "cuda/attention.cu",
           "const float base = m == neg_inf() ? 0.f : m;", "const float base = m;", k("attention")),
    Mutant("prefill attention shifts an all -inf tile by -inf", "numerics", "cuda/attention.cu",
           "const float base = mnew == neg_inf() ? 0.f : mnew;", "const float base = mnew;", k("attention")),
)


def scratch_tree() -> Path:
    """A copy of the working tree (tracked and untracked files git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    dst = Path(tempfile.mkdtemp(prefix="freetoken-mutants-"))
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    return dst


def run_one(tree: Path, m: Mutant) -> dict:
    path = tree / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return {"name": m.name, "kind": m.kind, "result": "stale", "detail": f"text not found once in {m.path}"}
    path.write_text(original.replace(m.old, m.new))
    env = {**os.environ, "FREETOKEN_CUDA_EMULATE": "1", "PYTHONPATH": str(tree)}
    if m.races:
        env.update(FREETOKEN_CUDA_EMULATE_RACES="1", FREETOKEN_CUDA_EMULATE_FUZZ="1")
    start = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            *m.tests], cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        path.write_text(original)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("E ")]
    return {"name": m.name, "kind": m.kind, "result": "caught" if r.returncode else "missed",
            "seconds": round(time.time() - start, 1), "detail": lines[0][1:].strip()[:300] if lines else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names (substrings)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mutants.json"))
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(s in m.name for s in args.only.split(","))]
    if args.list:
        for m in chosen:
            print(f"{m.kind:10} {m.name}")
        return 0
    tree, rows = scratch_tree(), []
    try:
        for m in chosen:
            rows.append(run_one(tree, m))
            row = rows[-1]
            print(f"{row['result']:7} {m.kind:10} {m.name} ({row.get('seconds', 0)} s)  {row['detail'][:140]}",
                  flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    caught = sum(r["result"] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} caught")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"caught": caught, "total": len(rows), "rows": rows}, indent=1))
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
