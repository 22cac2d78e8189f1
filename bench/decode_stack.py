"""A decode step with every layer in one numba call against one call a layer, in one process;
pairs: freetoken/kernels/decode_stack.py, docs/performance.md ("a decode step's Python").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/decode_stack.py MODEL \
        [--steps 400] [--run 8] [--out bench/results/decode_stack.json]

MODEL: a model directory, a GGUF file or synth:NAME (cpu backend, batch 1, greedy). One request
of --steps decode steps whose runs of --run steps alternate between the two ways (the ops' own
``decode_stack`` and none): whole processes on a shared VM differ by more than the effect, the
steps of one process do not. Per way: the median step, and the median time of a step outside the
outermost numba calls (the Python between them, each call's dispatch included in the calls).
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
from kernel_times import timed_kernels  # noqa: E402
from freetoken import LLM, SamplingParams  # noqa: E402


def measure(llm, steps: int, run: int) -> dict:
    """{way: (step seconds, seconds outside the kernels) per decode step}."""
    core, ops = llm.core, llm.core.model.ops
    stack = ops.decode_stack
    totals, counts = collections.defaultdict(float), collections.Counter()
    undo = timed_kernels(totals, counts)
    out = {"one call": [], "a call a layer": []}
    req = core.add_request(list(range(100, 164)), SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    core.step()                                                   # the prefill
    for i in range(steps):
        way = "one call" if (i // run) % 2 == 0 else "a call a layer"
        object.__setattr__(ops, "decode_stack", stack if way == "one call" else None)
        before, start = sum(totals.values()), time.perf_counter()
        core.step()
        step = time.perf_counter() - start
        out[way].append((step, step - (sum(totals.values()) - before)))
    undo()
    object.__setattr__(ops, "decode_stack", stack)
    assert req.finish_reason is not None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=400, help="decode steps, both ways together")
    ap.add_argument("--run", type=int, default=8, help="steps a way before switching")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_stack.json"))
    args = ap.parse_args(argv)
    llm = LLM(args.model, backend="cpu", max_running_requests=1)
    if llm.core.model.ops.decode_stack is None:
        sys.exit("this model's ops have no decode_stack (a cpu engine with cpu_decode_layer on has)")
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=2 * args.run + 2, ignore_eos=True))  # both compiled
    ways = measure(llm, args.steps, args.run)
    rows = {w: {"step_us": float(np.median([s for s, _ in v]) * 1e6),
                "outside_kernels_us": float(np.median([o for _, o in v]) * 1e6), "steps": len(v)}
            for w, v in ways.items()}
    print(f"# {machine()['cpu']['model']}; {args.model}; runs of {args.run} steps alternating")
    print(f"{'way':16} {'step us':>9} {'outside kernels us':>19}")
    for way, r in rows.items():
        print(f"{way:16} {r['step_us']:9.0f} {r['outside_kernels_us']:19.0f}")
    ratio = rows["a call a layer"]["step_us"] / rows["one call"]["step_us"]
    print(f"a call a layer / one call: {ratio:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "model": args.model, "run": args.run,
                                          "ways": rows, "ratio": ratio}, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
