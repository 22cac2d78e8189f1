"""``bench bw``: this machine's expert bandwidths on a model's real expert shape
(docs/design.md, The bandwidth profile).

B_H: the CPU executor (the production numba kernel on its worker thread), batch 1, top-k experts
from a rotating window over a synthetic bank much larger than the last-level cache, so every step
reads cold experts; median over many steps. B_P (with a GPU): the production fill kernel copying
k cold expert rows of a pinned host bank into slots, timed with CUDA events; median. Contended
pair (with a GPU): both loops at once for a few seconds. Also the CPU branch's per-layer hand-off
cost. Prints a table and writes the profile (moe/profile.py) keyed by GPU UUID and expert format;
without a GPU it measures B_H only, says so, and files the profile under "no-gpu".
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from freetoken.kernels.qformats import FORMATS
from freetoken.log import logger
from freetoken.cupy_loader import cupy as load_cupy

WARMUP = 8
EXPERT_FORMATS = ("bf16", "f32") + tuple(f.name for f in FORMATS)   # the dense two, then kernels/qformats.py's


def register(sub) -> None:
    p = sub.add_parser("bench", help="machine benchmarks (bw: PCIe and CPU expert bandwidths)")
    inner = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    bw = inner.add_parser("bw", help="measure B_P, B_H and the contended pair; write the profile")
    bw.add_argument("--model", default=None,
                    help="model directory or synth:NAME whose expert shape is measured "
                         "(default: the built-in demo model)")
    bw.add_argument("--threads", type=int, default=0, help="CPU executor threads (0: numba's default)")
    bw.add_argument("--out", default=None, help="profile file (default: $FREETOKEN_HOME/bench_bw.json)")
    bw.add_argument("--iters", type=int, default=64, help="timed steps per measurement (default: 64)")
    bw.add_argument("--seconds", type=float, default=2.0, help="contended pair duration (default: 2)")
    bw.add_argument("--format", default=None, choices=EXPERT_FORMATS, metavar="FORMAT",
                    help="expert format measured: bf16, f32 or a quantized one (q8_0, q4_k, q6_k, "
                         "fp8_b128, ...); each has its own profile entry (default: the model's dtype)")
    bw.add_argument("--bank-mib", type=int, default=1024,
                    help="synthetic expert bank size in MiB; keep it well above the LLC (default: 1024)")
    bw.set_defaults(run=run)


def expert_shape(model: str | None) -> dict:
    """{label, hidden, width, top_k, experts, format} of a model, read from its config only (a GGUF
    file: its metadata, and the format of its experts' blocks)."""
    from freetoken.models.gguf_file import is_gguf
    from freetoken.models.hf_config import model_config_from_dict, read_model_config
    from freetoken.models.demo import resolve_model_dir
    if model and is_gguf(model):
        cfg, fmt = _gguf_shape(model)
        return dict(label=model, hidden=cfg.hidden_size, width=cfg.moe_intermediate_size,
                    top_k=cfg.num_experts_per_tok, experts=cfg.num_experts * len(cfg.moe_layers), format=fmt)
    if model and model.startswith("synth:"):
        from freetoken.models.synth import parse_spec
        _, shape, _ = parse_spec(model[len("synth:"):])
        hf = shape.hf_config()
        cfg = model_config_from_dict(hf)
    else:
        folder = resolve_model_dir(model, logger)
        cfg, hf = read_model_config(folder), json.loads((Path(folder) / "config.json").read_text())
    fmt = _stored_format(hf.get("quantization_config"), cfg) or ("bf16" if cfg.torch_dtype == "bfloat16" else "f32")
    return dict(label=model or "demo", hidden=cfg.hidden_size, width=cfg.moe_intermediate_size,
                top_k=cfg.num_experts_per_tok, experts=cfg.num_experts * len(cfg.moe_layers), format=fmt)


def _stored_format(quantization: dict | None, cfg) -> str | None:
    """The experts' format as loaded from a quantized HF checkpoint's quantization_config (None: the
    model dtype's): gpt-oss's MXFP4 blocks stay mxfp4 (models/gpt_oss_weights.py); block FP8 stays
    fp8_b128 when both banks' rows are whole 128-value blocks, else it is widened (models/fp8_weights.py)."""
    method = (quantization or {}).get("quant_method")
    whole = cfg.hidden_size % 128 == 0 and cfg.moe_intermediate_size % 128 == 0
    return "mxfp4" if method == "mxfp4" else "fp8_b128" if method == "fp8" and whole else None


def _gguf_shape(path: str):
    """(ModelConfig, expert format) of a GGUF file: the format of its first MoE layer's gate
    experts, as the engine's profile key names it (engine/facts.expert_format)."""
    from freetoken.models.gguf_file import open_gguf
    from freetoken.models.gguf_weights import gguf_config
    model = open_gguf(path)
    cfg = gguf_config(model)
    kind = model.tensors[f"blk.{cfg.moe_layers[0]}.ffn_gate_exps.weight"].type_name.lower()
    return cfg, kind if kind in EXPERT_FORMATS else "f32"   # F16/F32 experts are widened to f32


def synthetic_bank(shape: dict, budget_bytes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """gate_up [n,2I,H], down [n,H,I]; n >= 2k so consecutive windows are disjoint. bf16 values
    are |w| in [2^-8, 2^-4) with random sign and mantissa: no denormals to slow the kernel.
    A quantized format: random blocks with small finite scales (qformats.random_blocks)."""
    H, I, k = shape["hidden"], shape["width"], shape["top_k"]
    if shape["format"] not in ("bf16", "f32"):
        return _quantized_bank(shape, budget_bytes, seed)
    dtype = np.uint16 if shape["format"] == "bf16" else np.float32
    per = 3 * I * H * np.dtype(dtype).itemsize
    n = max(2 * k, min(shape["experts"], budget_bytes // per))
    rng = np.random.default_rng(seed)

    def make(*dims):
        if dtype == np.float32:
            return (rng.standard_normal(dims, np.float32) * 0.02).astype(np.float32)
        bits = rng.integers(0, 1 << 16, dims, dtype=np.uint16)
        return (bits & np.uint16(0x81FF)) | np.uint16(119 << 7)
    return make(n, 2 * I, H), make(n, H, I)


def _quantized_bank(shape: dict, budget_bytes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from freetoken.kernels.qformats import format_named, random_blocks
    H, I, k, fmt = shape["hidden"], shape["width"], shape["top_k"], format_named(shape["format"])
    if H % fmt.values or I % fmt.values:
        raise SystemExit(f"bench bw --format {fmt.name}: the hidden size {H} and expert width {I} must be "
                         f"whole blocks of {fmt.values} values")
    per = 3 * H * I // fmt.values * fmt.nbytes
    n = max(2 * k, min(shape["experts"], budget_bytes // per))
    rng = np.random.default_rng(seed)
    return random_blocks(fmt.name, (n, 2 * I), H, rng), random_blocks(fmt.name, (n, H), I, rng)


def _windows(n: int, k: int):
    start = 0
    while True:
        yield ((start + np.arange(k)) % n).astype(np.int32)
        start = (start + k) % n


def measure_b_h(bank, shape, threads: int, iters: int) -> float:
    """GB/s of weights the CPU executor streams at batch 1 over cold experts (median step)."""
    from freetoken.kernels.experts import cpu as experts_cpu
    from freetoken.moe.executor import CpuExecutor
    gate_up, down = bank
    k, per = shape["top_k"], gate_up[0].nbytes + down[0].nbytes
    x = np.random.default_rng(1).standard_normal((1, shape["hidden"]), np.float32)
    w = np.full((1, k), 1.0 / k, np.float32)
    out = np.empty_like(x)
    times, win = [], _windows(gate_up.shape[0], k)
    with CpuExecutor(experts_cpu, threads) as ex:
        for i in range(WARMUP + iters):
            ids = next(win)[None]
            t0 = time.perf_counter()
            ex.run(x, ids, w, gate_up, down, out)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
    return k * per / float(np.median(times)) / 1e9


class FillBench:
    """The production fill kernel copying k cold rows, pinned host bank -> slots, per call."""

    def __init__(self, host_pool, shape):
        cp = load_cupy()

        from freetoken.moe.residency_gpu import GpuResidency
        gu, dn = host_pool.banks[0].gate_up, host_pool.banks[0].down
        self.k, self.n = shape["top_k"], gu.shape[0]
        self.host = host_pool.device_views(0)
        self.pool = (cp.zeros((self.k,) + gu.shape[1:], gu.dtype), cp.zeros((self.k,) + dn.shape[1:], dn.dtype))
        self.res = GpuResidency(1, min(self.n, 4096), self.k)
        self.res.fill_slots[:self.k] = cp.arange(self.k, dtype=cp.int32)
        self.res.fill_count[0] = self.k
        self.res.max_rows = self.k
        self.bytes = self.k * (gu[0].nbytes + dn[0].nbytes)
        self.windows = _windows(self.n, self.k)
        self.cp = cp

    def once(self) -> float:
        """Seconds of one k-row fill, CUDA events around it."""
        cp = self.cp
        self.res.fill_experts[:self.k] = cp.asarray(next(self.windows))
        start, end = cp.cuda.Event(), cp.cuda.Event()
        stream = cp.cuda.get_current_stream()
        start.record(stream)
        self.res.fill(self.host, self.pool)
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3


def measure_contended(fill: FillBench, bank, shape, threads: int, seconds: float) -> dict:
    """Both loops at once for `seconds`: GB/s each achieved while the other runs."""
    cpu_bytes, barrier, stop = [0], threading.Barrier(2), threading.Event()
    per_step = shape["top_k"] * (bank[0][0].nbytes + bank[1][0].nbytes)

    def cpu_loop():
        from freetoken.kernels.experts import cpu as experts_cpu
        from freetoken.moe.executor import CpuExecutor
        x = np.ones((1, shape["hidden"]), np.float32)
        w = np.full((1, shape["top_k"]), 1.0 / shape["top_k"], np.float32)
        win = _windows(bank[0].shape[0], shape["top_k"])
        with CpuExecutor(experts_cpu, threads) as ex:
            ex.run(x, next(win)[None], w, *bank)
            barrier.wait()
            while not stop.is_set():
                ex.run(x, next(win)[None], w, *bank)
                cpu_bytes[0] += per_step

    worker = threading.Thread(target=cpu_loop, daemon=True)
    worker.start()
    barrier.wait()
    t0, fill_bytes = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fill.once()
        fill_bytes += fill.bytes
    stop.set()
    worker.join()
    elapsed = time.perf_counter() - t0
    return {"pcie_gbs": fill_bytes / elapsed / 1e9, "cpu_gbs": cpu_bytes[0] / elapsed / 1e9}


def cpu_facts(threads: int) -> dict:
    model, cores = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = None
            for line in f:
                key, _, value = (s.strip() for s in line.partition(":"))
                if key == "model name":
                    model = value
                elif key == "physical id":
                    phys = value
                elif key == "core id":
                    cores.add((phys, value))
    except OSError:
        pass
    return {"model": model, "physical_cores": len(cores) or os.cpu_count(),
            "threads": threads or os.cpu_count()}


def run(args) -> int:
    from freetoken.backend import cuda_unavailable_reason
    from freetoken.moe import profile as prof
    from freetoken.moe.cpu_branch import measure_handoff
    shape = expert_shape(args.model)
    if args.format:
        shape["format"] = args.format
    bank = synthetic_bank(shape, args.bank_mib << 20)
    per = bank[0][0].nbytes + bank[1][0].nbytes
    no_gpu = cuda_unavailable_reason()
    print(f"bench bw: {shape['label']}, {shape['format']} experts of {per / 2**20:.2f} MiB "
          f"(H {shape['hidden']}, I {shape['width']}, top-{shape['top_k']}), bank of "
          f"{bank[0].shape[0]} experts ({(bank[0].nbytes + bank[1].nbytes) / 2**20:.0f} MiB)")
    b_h = measure_b_h(bank, shape, args.threads, args.iters)
    b_p = contended = None
    gpu_id = (prof.NO_GPU, "none")
    if no_gpu:
        print(f"no GPU ({no_gpu}): measuring B_H only; B_P and the contended pair need a GPU")
    else:
        from freetoken.cupy_loader import emulated
        if emulated():
            print("emulated CUDA device (FREETOKEN_CUDA_EMULATE=1): B_P is the emulator's host "
                  "memcpy, not a PCIe link; the profile is filed under the emulated device's UUID")
        b_p, contended, gpu_id = _gpu_part(bank, shape, args)
    handoff = measure_handoff(tokens=1, hidden=shape["hidden"], top_k=shape["top_k"], iters=100)
    p = prof.Profile(gpu_uuid=gpu_id[0], gpu_name=gpu_id[1], format=shape["format"], expert_bytes=per,
                     b_h_gbs=_sig(b_h), b_p_gbs=None if b_p is None else _sig(b_p),
                     contended=contended, timestamp=datetime.now().isoformat(timespec="seconds"),
                     host=platform.node(), cpu=cpu_facts(args.threads),
                     handoff_us={m: handoff[m]["total_us"] for m in ("thread", "inline")})
    choice, reason = prof.recommend(p, fits=False) if b_p else ("cpu", "no GPU: only B_H was measured")
    p = dataclasses.replace(p, recommended=choice, reason=reason)
    _table(p, handoff, args)
    print(f"profile written to {prof.save_profile(p, args.out, logger)}")
    return 0


def _gpu_part(bank, shape, args):
    from freetoken.moe.device import gpu_identity
    from freetoken.moe.host_pool import pin_host_pool
    host = pin_host_pool([bank], logger, desc="pinning the bench bank")
    if not host.pinned:
        raise RuntimeError("bench bw: pinning the synthetic bank failed, so B_P cannot be measured")
    with host:
        fill = FillBench(host, shape)
        times = [fill.once() for _ in range(WARMUP + args.iters)][WARMUP:]
        b_p = fill.bytes / float(np.median(times)) / 1e9
        contended = measure_contended(fill, host.host(0), shape, args.threads, args.seconds)
    contended = {k: _sig(v) for k, v in contended.items()}
    return b_p, contended, gpu_identity()


def _sig(v: float) -> float:
    return float(f"{v:.4g}")          # 4 significant digits: the machines are noisier than that


def _table(p, handoff, args) -> None:
    from freetoken.moe.profile import phi
    rows = [("B_H", "CPU expert kernel, batch 1, cold experts", f"{p.b_h_gbs:.3g} GB/s")]
    if p.b_p_gbs is not None:
        rows.append(("B_P", "fill, pinned host -> slots, cold rows", f"{p.b_p_gbs:.3g} GB/s"))
        c = p.contended
        rows.append(("both", f"contended pair over {args.seconds:g} s",
                     f"fill {c['pcie_gbs']:.2f} GB/s, CPU {c['cpu_gbs']:.2f} GB/s"))
        rows.append(("phi", "fetch fraction the engine will use", f"{phi(p):.4f}"))
    rows.append(("hand-off", "CPU branch per layer (stage+hand-off+merge)",
                 f"thread {handoff['thread']['total_us']:.0f} us, inline {handoff['inline']['total_us']:.0f} us"))
    for name, what, value in rows:
        print(f"  {name:<9} {what:<44} {value}")
    print(f"  recommended --moe-backend {p.recommended}: {p.reason}")
