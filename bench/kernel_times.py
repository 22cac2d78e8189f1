"""Where a decode step's time goes, kernel by kernel: every numba kernel call timed through the
public LLM API; pairs: docs/performance.md ("int8 dots for the quantized files"),
freetoken/kernels/_numba.py (LazyKernel, whose call this wraps).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/kernel_times.py MODEL \
        [--decode 64] [--composed] [--out bench/results/kernel_times.json]

MODEL: a model directory, a GGUF file or synth:NAME (cpu backend, batch 1, greedy, a random
64-token prompt). One untimed run (compiles), one plain run (the step time), one with every
outermost kernel call timed (calls made from inside a kernel count in their caller: a decode
step of a Qwen3-MoE is one ``_stack`` call, kernels/decode_stack.py; ``--composed`` calls the ops
one by one, as ``--no-cpu-decode-layer`` does, so that each gets its own line). The step minus the
kernels is the Python between them plus each call's dispatch.
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from _machine import machine  # noqa: E402
from freetoken import LLM, SamplingParams  # noqa: E402
from freetoken.kernels import _numba  # noqa: E402


def timed_kernels(totals, counts):
    """Patch LazyKernel.__call__ to add each outermost call's seconds to totals[name]."""
    plain, depth = _numba.LazyKernel.__call__, [0]

    def call(self, *args):
        if depth[0]:
            return plain(self, *args)
        depth[0] += 1
        start = time.perf_counter()
        try:
            return plain(self, *args)
        finally:
            totals[self.__name__] += time.perf_counter() - start
            counts[self.__name__] += 1
            depth[0] -= 1
    _numba.LazyKernel.__call__ = call
    return lambda: setattr(_numba.LazyKernel, "__call__", plain)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--decode", type=int, default=64, help="generated tokens per run")
    ap.add_argument("--composed", action="store_true", help="the ops one call each (cpu_decode_layer off)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel_times.json"))
    args = ap.parse_args(argv)
    llm = LLM(args.model, backend="cpu", cpu_decode_layer=not args.composed)
    vocab = llm.core.model_config.vocab_size            # ids the model has (synth:tiny: 4096)
    prompt = [[int(t) for t in np.random.default_rng(0).integers(100, min(8000, vocab), 64)]]
    params = SamplingParams(max_tokens=args.decode, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompt, params)
    step = (time.perf_counter() - start) / args.decode
    totals, counts = collections.defaultdict(float), collections.Counter()
    undo = timed_kernels(totals, counts)
    llm.generate(prompt, params)
    undo()
    n = args.decode
    print(f"# {machine()['cpu']['model']}; {args.model}{' (composed)' if args.composed else ''}; per generated token "
          "(its share of the prefill included)")
    print(f"step {step * 1e3:.2f} ms, kernels {sum(totals.values()) / n * 1e3:.2f} ms")
    print(f"{'kernel':28} {'ms/token':>9} {'calls':>6} {'us/call':>8}")
    for name, sec in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{name:28} {sec / n * 1e3:9.3f} {counts[name] / n:6.1f} {sec / counts[name] * 1e6:8.1f}")
    rows = {k: {"ms_per_token": v / n * 1e3, "calls_per_token": counts[k] / n} for k, v in totals.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "model": args.model, "composed": args.composed,
                                          "step_ms": step * 1e3,
                                          "kernels": rows}, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
