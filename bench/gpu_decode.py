"""End-to-end GPU speed of a synthetic Qwen3-30B-A3B slice, and CUDA-graph vs eager decode step
time; pairs: freetoken/engine/graphs.py, freetoken/models/synth.py, docs/performance.md.

    python bench/gpu_decode.py [--model synth:qwen3-30b-a3b,layers=12] [--prompt 512]
        [--decode 64] [--context 2048] [--steps 50] [--out bench/results/gpu_decode.json]

Through the public LLM API (backend cuda, --moe-backend fused, every expert resident): decode
tok/s at batch 1 and 4 (greedy, ignore_eos, random prompts) and prefill tok/s of one prompt.
Then, on the engine's own model object, one decode step (batch 1 and 4, every sequence at
--context tokens) timed eagerly and as a replayed CUDA graph: wall time from handing over the
host batch to the logits being ready, median of --steps. The graph removes the per-kernel launch
overhead of Python (about 20 launches per layer), which at batch 1 is most of an eager step.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from freetoken.cupy_loader import cupy as load_cupy  # noqa: E402  (after the repo is on the path)


def generate_speed(llm, batch: int, prompt: int, decode: int, rng) -> dict:
    """Median decode and prefill tok/s of one generate() call over `batch` random prompts."""
    from freetoken import SamplingParams
    vocab = llm.core.model_config.vocab_size
    prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    decode_tok_s = sum(o.metrics["decode_tok_s"] for o in outs)   # concurrent streams add up
    return dict(batch=batch, prompt=prompt, decode=decode, wall_s=wall, decode_tok_s=decode_tok_s,
                prefill_tok_s=statistics.median(o.metrics["prefill_tok_s"] for o in outs))


def decode_batch(core, B: int, context: int, rng):
    """A host ForwardBatch of B sequences, each decoding its token number `context`."""
    from freetoken.models.forward_batch import ForwardBatch
    slots = np.asarray(core.kv.alloc(B * context), np.int32).reshape(B, context)
    i32 = lambda a: np.asarray(a, np.int32)
    rows = {} if core.states is None else dict(state_slots=i32(range(B)), seq_starts=i32(range(B + 1)))
    return ForwardBatch(ids=i32(rng.integers(0, core.model_config.vocab_size, B)),
                        positions=i32([context - 1] * B), tok_seq=i32(range(B)),
                        slots=slots[:, -1].copy(), slot_table=slots, last_index=i32(range(B)),
                        prefill=False, **rows), slots


def step_times(core, graphs, batch, steps: int) -> dict:
    """Median ms of one decode step, eager (inputs to device, forward) and graph replay."""
    cp = load_cupy()

    def timed(fn):
        times = []
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[3:])
    to_dev = lambda b: type(b)(**{k: (core.ops.to_device(v) if isinstance(v, np.ndarray) else v)
                                  for k, v in b.__dict__.items()})
    eager = timed(lambda: core.model.forward(to_dev(batch)))
    graph = timed(lambda: graphs.forward(batch))
    return dict(batch=len(batch.ids), eager_ms=eager, graph_ms=graph, speedup=eager / graph)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synth:qwen3-30b-a3b,layers=12")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048, help="context of the timed graph steps")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_decode.json"))
    args = ap.parse_args(argv)
    from freetoken import LLM
    from freetoken.engine.graphs import DecodeGraphs
    rng = np.random.default_rng(0)
    llm = LLM(model=args.model, backend="cuda", moe_backend="fused", max_running_requests=4)
    generate_speed(llm, 1, 32, 4, rng)                                    # warm-up: compiles
    runs = [generate_speed(llm, b, args.prompt, args.decode, rng) for b in (1, 4)]
    print(f"{args.model}, fused, greedy: prompt {args.prompt}, decode {args.decode}")
    print(f"{'batch':>5} {'decode tok/s':>13} {'prefill tok/s':>14} {'wall s':>7}")
    for r in runs:
        print(f"{r['batch']:>5} {r['decode_tok_s']:13.1f} {r['prefill_tok_s']:14.0f} {r['wall_s']:7.2f}")
    core = llm.core
    graphs = DecodeGraphs(core.model, core.ops, 4, args.context)
    graphs.capture_all()           # no request is live: the warm-up's dummy K/V rows harm nothing
    steps = []
    for B in (1, 4):
        batch, slots = decode_batch(core, B, args.context, rng)
        steps.append(step_times(core, graphs, batch, args.steps))
        core.kv.free(slots.ravel().tolist())
    print(f"decode step at context {args.context}: {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'x':>5}")
    for s in steps:
        print(f"{'':>33}{s['batch']:>5} {s['eager_ms']:9.2f} {s['graph_ms']:9.2f} {s['speedup']:5.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(model=args.model, host=platform.node(),
                                              generate=runs, steps=steps), indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
