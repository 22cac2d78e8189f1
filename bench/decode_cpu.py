"""End-to-end CPU decode speed against this machine's memory read bandwidth; pairs:
docs/performance.md ("CPU decode"), freetoken/models/synth.py, freetoken/kernels/_membw.py.

    .venv/bin/python bench/decode_cpu.py [--models demo,synth:medium,synth:qwen3.6-35b-a3b,layers=4] [--rounds 3]
        [--prompt 64] [--decode 128] [--threads N] [--profile] [--out bench/results/decode_cpu.json]

A model is 'demo' (the packaged one), a model directory or synth:NAME; MODEL@BACKEND sets the
engine's moe_backend for that entry (e.g. synth:medium@fused), else --moe-backend applies.

Batch 1, greedy, ignore_eos, through the public LLM API (so engine overheads count). Each model is
loaded once and warmed up by one full run (numba compiles excluded); then the models run
interleaved, round after round, with a fresh read-bandwidth measurement in each round, and the
table shows medians (the machine is shared and noisy: compare within one run).

Active MB/token: weight bytes one decode step must read: every non-expert weight (attention,
norms, routers, the full lm_head, one embedding row) plus top-k experts per MoE layer. Effective
GB/s = active bytes x decode tok/s; "% read" compares it with a numba parallel read of a 1 GiB
array on the same number of threads. A model whose weights fit in the last-level cache can pass
100%; one whose step time is dominated by per-op overheads sits far below.

--profile adds, per model, a per-op breakdown of one run (ms per decode step by op, the MoE
layer's time split into the expert kernel and the executor hand-off, and the engine's own
per-step work: scheduling, batch building, sampling, detokenizing), then the same for its prompt's
prefill (--prompt 512 or 4000 for where a long prefill's time goes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]   # the checkout's freetoken; bench/ also when imported

from _machine import cpu_info                                 # noqa: E402
from freetoken import LLM, SamplingParams                     # noqa: E402
from freetoken.backend import OP_NAMES                         # noqa: E402
from freetoken.kernels._membw import measure_read_bandwidth    # noqa: E402
from freetoken.kernels._numba import load_numba                # noqa: E402


# --- bytes ------------------------------------------------------------------------------------

def weight_stats(cfg, w) -> dict:
    """Parameter count and the weight bytes one decode token reads (see the module doc); for a
    hybrid also the recurrent state each token reads and writes (state_bytes)."""
    arrays = {id(a): a for a in _arrays(w)}
    params = sum(a.size for a in arrays.values())
    k = cfg.num_experts_per_tok
    per_token = w.embed[0].nbytes + w.final_norm.nbytes + _nbytes(w.lm_head)
    experts = 0
    for lw in w.layers:
        routed = {"gate_up", "down"} if lw.router is not None else set()
        per_token += sum(_nbytes(a) for name, a in _layer_arrays(lw) if name not in routed)
        if routed:
            experts += k * (lw.gate_up[0].nbytes + lw.down[0].nbytes)
    state = 0
    if cfg.has_gdn:
        from freetoken.engine.state_pool import StatePool
        state = 2 * StatePool.bytes_per_row(cfg)          # read and written once per token
    return dict(params=int(params), weight_bytes=int(sum(a.nbytes for a in arrays.values())),
                active_bytes=int(per_token + experts + state), active_expert_bytes=int(experts),
                state_bytes=int(state))


def _nbytes(a) -> int:
    """Bytes of a weight, or of a tuple of parts (a GGUF q/k/v in formats of its own)."""
    return sum(p.nbytes for p in a) if isinstance(a, tuple) else a.nbytes


def _layer_arrays(lw):
    """(field name, array) of every weight array of a layer (Qwen3-MoE or hybrid)."""
    return [(f.name, getattr(lw, f.name)) for f in dataclasses.fields(lw) if getattr(lw, f.name) is not None]


def _arrays(w):
    """Every weight array (each part of a stacked weight on its own)."""
    for a in (w.embed, w.final_norm, w.lm_head, *(a for lw in w.layers for _, a in _layer_arrays(lw))):
        yield from (a if isinstance(a, tuple) else (a,))


def kv_bytes_per_token(cfg, kv_itemsize: int, context: int) -> int:
    """KV cache bytes attention reads for one decode token at this context length: the full
    layers' at every position (the plan's per-token bytes), a sliding layer's at its window's."""
    from freetoken.engine.plan_memory import checkpoint_bytes, kv_bytes_per_token as full_layers
    W = cfg.sliding_window
    window = checkpoint_bytes(cfg, kv_itemsize) * min(context, W) // W if cfg.sliding_kv else 0
    return full_layers(cfg, kv_itemsize) * context + window


# --- runs -------------------------------------------------------------------------------------

def run_once(llm, prompt, n_decode) -> dict:
    out = llm.generate(prompt, SamplingParams(max_tokens=n_decode, ignore_eos=True))[0]
    m = out.metrics
    assert m["generated_tokens"] == n_decode, m
    return dict(prefill_tok_s=m["prefill_tok_s"], decode_tok_s=m["decode_tok_s"],
                tokens=out.token_ids)


class OpTimer:
    """Wraps the model's ops, the MoE op and the engine's per-step functions with timers, split by
    phase (prefill/decode, from the batch); undo() restores everything."""

    def __init__(self, llm):
        import freetoken.engine.runner as runner
        self.t = {"prefill": defaultdict(float), "decode": defaultdict(float)}
        self.n = {"prefill": defaultdict(int), "decode": defaultdict(int)}
        self.steps = {"prefill": 0, "decode": 0}
        self.phase = "decode"
        core, model = llm.core, llm.core.model
        self._undo = []
        ops = model.ops
        wrapped = {name: self._wrap(getattr(ops, name), name) for name in OP_NAMES}
        wrapped["linear"] = self._wrap(ops.linear, "linear", by_shape=True)
        self._set(model, "ops", dataclasses.replace(ops, **wrapped))
        moe = core.moe
        self._set(moe, "forward", self._wrap(moe.forward, "moe.forward (total)"))
        branch = getattr(moe, "branch", None)          # the CPU share: inline or on the executor
        if branch is not None:
            self._set(branch, "_op", self._wrap(branch._op, "experts kernel (cpu branch)"))
            if getattr(branch, "executor", None) is not None:
                self._set(branch.executor, "_op", self._wrap(branch.executor._op, "experts kernel (executor)"))
        if hasattr(moe, "_op"):
            self._set(moe, "_op", self._wrap(moe._op, "experts kernel (direct)"))

        owner = core if hasattr(core, "forward") else model     # the engine's forward callable
        fwd = owner.forward
        timed_fwd = self._wrap(fwd, "model.forward (total)")

        def forward(batch):
            self.phase = "prefill" if batch.prefill else "decode"
            self.steps[self.phase] += 1
            return timed_fwd(batch)

        self._set(owner, "forward", forward)
        self._set(runner, "build_batch", self._wrap(runner.build_batch, "engine: build_batch"))
        self._set(runner, "sample", self._wrap(runner.sample, "engine: sample"))
        self._set(core.scheduler, "schedule", self._wrap(core.scheduler.schedule, "engine: schedule"))
        self._set(core, "_append", self._wrap(core._append, "engine: append+detokenize"))
        self._set(core, "step", self._wrap(core.step, "engine: step (total)"))

    def _set(self, obj, name, value):
        had = name in vars(obj)          # instance/module attribute, not a class method
        old = getattr(obj, name)
        self._undo.append((obj, name, old, had))
        setattr(obj, name, value)

    def _wrap(self, fn, name, by_shape=False):
        """fn timed under `name` (by_shape: under 'name [M,K]' of its second argument too)."""
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                ph = self.phase
                self.t[ph][name] += dt
                self.n[ph][name] += 1
                if by_shape:
                    parts = a[1] if isinstance(a[1], tuple) else (a[1],)
                    sub = f"  {name} {' + '.join(str(list(p.shape)) for p in parts)}"
                    self.t[ph][sub] += dt
                    self.n[ph][sub] += 1
        return timed

    def undo(self):
        for obj, name, old, had in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

    def report(self, phase="decode") -> dict:
        """{name: ms per step, calls per step}, slowest first; a by-shape row ('  linear [M,K]')
        follows its op's row."""
        steps = max(self.steps[phase], 1)
        t = self.t[phase]
        order = []
        for name in sorted((n for n in t if not n.startswith(" ")), key=lambda n: -t[n]):
            order.append(name)
            order += sorted((n for n in t if n.startswith(f"  {name} ")), key=lambda n: -t[n])
        return {name: dict(ms_per_step=1e3 * t[name] / steps, calls_per_step=self.n[phase][name] / steps)
                for name in order}


def profile(llm, prompt, n_decode) -> dict:
    timer = OpTimer(llm)
    try:
        t0 = time.perf_counter()
        res = run_once(llm, prompt, n_decode)
        wall = time.perf_counter() - t0
    finally:
        timer.undo()
    return dict(decode=timer.report("decode"), prefill=timer.report("prefill"),
                decode_steps=timer.steps["decode"], decode_tok_s=res["decode_tok_s"], wall_s=wall)


def print_profile(name, prof):
    """The decode profile (ms per decode step), then the prompt's prefill (ms for the whole prompt:
    one step per prefill chunk)."""
    for phase, steps in (("decode", prof["decode_steps"]), ("prefill", None)):
        rows = prof[phase]
        step = rows.get("engine: step (total)", {}).get("ms_per_step", 0.0)
        what = (f"{steps} steps, {prof['decode_tok_s']:.1f} tok/s with timers ({step:.2f} ms per step)"
                if phase == "decode" else f"the prompt, {step:.1f} ms per prefill step")
        print(f"\n-- {name}: {phase} profile, {what} --")
        print(f"{'what':34s} {'ms/step':>8s} {'calls':>6s} {'% step':>7s}   (indented: part of the op above)")
        for op, r in rows.items():
            print(f"{op:34s} {r['ms_per_step']:8.3f} {r['calls_per_step']:6.0f} "
                  f"{100 * r['ms_per_step'] / step if step else 0:6.1f}%")


# --- main -------------------------------------------------------------------------------------

def machine() -> dict:
    return dict(cpu=cpu_info()["model"], cores=os.cpu_count(), python=platform.python_version(),
                numpy=np.__version__, numba=load_numba().__version__,
                date=time.strftime("%Y-%m-%d %H:%M"))


def model_specs(text: str) -> list[str]:
    """The --models list: commas separate models, except before a synth option (NAME=VALUE),
    which belongs to the synth:SPEC before it (synth:qwen3.6-35b-a3b,layers=4)."""
    specs: list[str] = []
    for part in text.split(","):
        if specs and "=" in part.split("@")[0] and specs[-1].startswith("synth:"):
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,synth:medium",
                    help="comma list: 'demo' (the packaged model), a directory, or synth:NAME; "
                         "MODEL@BACKEND overrides --moe-backend for that entry (e.g. synth:medium@fused)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--decode", type=int, default=128, help="generated tokens per run")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (0: numba's default)")
    ap.add_argument("--moe-backend", default="auto",
                    help="EngineConfig.moe_backend (auto: cpu without a GPU, experts on the executor thread)")
    ap.add_argument("--profile", action="store_true", help="per-op breakdown of one decode run per model")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_cpu.json"))
    args = ap.parse_args(argv)

    numba = load_numba()
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(threads)
    info = machine()
    print(f"# {info['cpu']}, {info['cores']} cores, {threads} threads, {info['date']}", flush=True)

    models = {}
    for spec in model_specs(args.models):
        spec = spec.strip()
        model, _, moe_backend = spec.partition("@")
        t0 = time.perf_counter()
        # no prefix cache: every round repeats the prompt, which would otherwise come from the
        # cache and make the prefill column a cache hit (hybrids keep no prefix cache at all)
        llm = LLM(model=None if model == "demo" else model, backend="cpu", max_running_requests=1,
                  moe_backend=moe_backend or args.moe_backend, moe_cpu_threads=threads,
                  enable_prefix_cache=False)
        cfg = llm.core.model_config
        rng = np.random.default_rng(0)
        vocab = min(cfg.vocab_size, llm.tokenizer.vocab_size)
        prompt = rng.integers(10, vocab, args.prompt).tolist()
        stats = weight_stats(cfg, llm.core.weights)
        kv_item = llm.core.kv.layer(0)[0].itemsize
        stats["kv_bytes_at_end"] = kv_bytes_per_token(cfg, kv_item, args.prompt + args.decode)
        t1 = time.perf_counter()
        run_once(llm, prompt, args.decode)                      # warm-up: numba compiles
        print(f"# {spec}: loaded in {t1 - t0:.1f} s, warm-up run {time.perf_counter() - t1:.1f} s, "
              f"{stats['params'] / 1e6:.1f} M params, {stats['active_bytes'] / 1e6:.1f} MB/token",
              flush=True)
        models[spec] = dict(llm=llm, prompt=prompt, stats=stats, runs=[], moe=llm.core.moe.backend)

    bws = []
    for r in range(args.rounds):
        bws.append(measure_read_bandwidth(threads))
        line = [f"round {r + 1}: read {bws[-1]:.1f} GB/s"]
        for spec, m in models.items():
            res = run_once(m["llm"], m["prompt"], args.decode)
            m["runs"].append({k: v for k, v in res.items() if k != "tokens"})
            m.setdefault("tokens", res["tokens"])
            line.append(f"{spec} {res['decode_tok_s']:.1f} tok/s")
        print("# " + ", ".join(line), flush=True)
    read = statistics.median(bws)

    results = []
    for spec, m in models.items():
        dec = statistics.median(x["decode_tok_s"] for x in m["runs"])
        pre = statistics.median(x["prefill_tok_s"] for x in m["runs"])
        eff = m["stats"]["active_bytes"] * dec / 1e9
        results.append(dict(model=spec, moe_backend=m["moe"], **m["stats"], decode_tok_s=dec,
                            effective_gbs=eff, read_gbs=read, fraction_of_read=eff / read,
                            prefill_tok_s=pre, runs=m["runs"],
                            distinct_generated=len(set(m["tokens"]))))

    print(f"\n{'model':16s} {'params':>8s} {'active MB/tok':>13s} {'decode tok/s':>12s} "
          f"{'eff. GB/s':>9s} {'read GB/s':>9s} {'% read':>6s} {'prefill tok/s':>13s}")
    for x in results:
        print(f"{x['model']:16s} {x['params'] / 1e6:7.1f}M {x['active_bytes'] / 1e6:13.1f} "
              f"{x['decode_tok_s']:12.1f} {x['effective_gbs']:9.1f} {x['read_gbs']:9.1f} "
              f"{100 * x['fraction_of_read']:5.0f}% {x['prefill_tok_s']:13.1f}")

    if args.profile:
        for x in results:
            m = models[x["model"]]
            x["profile"] = profile(m["llm"], m["prompt"], args.decode)
            print_profile(x["model"], x["profile"])

    for m in models.values():
        m["llm"].core.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=info, threads=threads, args=vars(args),
                                   read_gbs_rounds=bws, results=results), indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
