"""``kernel OP [--check] [--bench]``: run one op's kernel against its numpy reference on fresh
random inputs (worst error and where), then time it. With a GPU the op's ``gpu`` runs, timed as
one CUDA graph of many launches against the device's peak; without one, its ``cpu`` runs instead
and the report says so. Inputs come from freetoken/kernels/cases.py."""
from __future__ import annotations

import importlib
import time
from dataclasses import replace
from functools import partial

import numpy as np
from freetoken.cupy_loader import cupy as load_cupy


def register(sub) -> None:
    from freetoken.kernels.cases import BLOCK_DTYPES, OPS
    from freetoken.kernels.qact import DOTS
    p = sub.add_parser("kernel", help="check one op's kernel against its numpy reference; time it")
    p.add_argument("op", choices=sorted(OPS), help="op module in freetoken/kernels/")
    p.add_argument("--check", action="store_true",
                   help="compare with ref: max abs/rel error and where (the default action)")
    p.add_argument("--bench", action="store_true",
                   help="time it: GB/s and TFLOP/s as shares of the device's peaks (a GPU's from its attributes; the CPU's measured: read bandwidth, and the multiply-add instruction the op runs on)")
    p.add_argument("--shape", default="", metavar="NAME=N,...",
                   help="override the op's default dims, e.g. T=7,H=4096 (the report shows all)")
    p.add_argument("--dtype", choices=("bf16", "f32") + BLOCK_DTYPES, default="bf16",
                   help="weight / KV cache dtype; a quantized format (q4_k, ...) for the weights of "
                        "embedding, linear and experts (random blocks) (default: bf16)")
    p.add_argument("--dots", choices=DOTS, default="int8",
                   help="cpu linear and experts over GGUF block formats: int8 rounds the activations "
                        "to 8 bits per 32 values, and bf16 experts' to bf16 (the engine's --cpu-dots "
                        "default; ref rounds alike), f32 does not (default: int8)")
    p.add_argument("--iters", type=int, default=100,
                   help="calls per timing; one CUDA graph on a GPU (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPU when CuPy sees one, else the cpu version (default: auto)")
    p.set_defaults(run=run)


def parse_dims(text: str) -> dict:
    """'T=7,H=4096' -> {'T': 7, 'H': 4096}."""
    dims = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--shape: expected NAME=N, got {item!r}")
        dims[name.strip()] = int(value)
    return dims


def pick_device(requested: str) -> tuple[str, str]:
    """('cuda' | 'cpu', why)."""
    from freetoken.backend import cuda_unavailable_reason, visible_device
    if requested == "cpu":
        return "cpu", "requested"
    reason = cuda_unavailable_reason()
    if reason is None:
        return "cuda", visible_device()
    if requested == "cuda":
        raise RuntimeError(f"--device cuda: {reason}")
    return "cpu", f"no GPU ({reason}): running the cpu version against ref instead"


def run(args) -> int:
    from freetoken.kernels import cases
    case = cases.build(args.op, parse_dims(args.shape), args.dtype, np.random.default_rng(args.seed))
    device, why = pick_device(args.device)
    impl = "gpu" if device == "cuda" else "cpu"
    module = importlib.import_module(f"freetoken.kernels.{args.op}")
    fn, ref = getattr(module, impl, None), module.ref
    if fn is None:
        raise RuntimeError(f"{args.op} has no {impl} version yet")
    dims, dots = " ".join(f"{k}={v}" for k, v in case.dims.items()), ""
    if impl == "cpu" and args.op in ("linear", "experts") and _has_int8_dots(args.dtype):
        fn, ref, dots = partial(fn, dots=args.dots), partial(ref, dots=args.dots), f", {args.dots} dots"
    elif impl == "cpu" and args.op == "experts" and args.dtype == "bf16" and args.dots == "int8":
        # as the engine's cpu backend runs them: inputs rounded to bf16 (kernels/experts_bf16.py);
        # an input that the two fp32 orders put across a rounding step moves its outputs by a bf16 step
        fn, ref, dots = partial(fn, bf16=True), partial(ref, bf16=True), ", activations rounded to bf16"
        case = replace(case, tol=(2.0 ** -8, case.tol[1]), atol_of_max=True)
    print(f"{args.op} [{dims}] dtype {args.dtype}{dots}: {args.op}.{impl} ({why})")
    if impl == "cpu" and args.op == "attention":
        from freetoken.kernels.attention_decode import describe
        print(f"  {describe(case.dims['Hq'] // case.dims['G'], case.dims['D'])}")
    ok = check(fn, ref, case, device) if args.check or not args.bench else True
    if args.bench:
        bench(fn, case, device, max(1, args.iters), compute_kind(args) if impl == "cpu" else "fp32")
    return 0 if ok else 1


def compute_kind(args) -> str:
    """Which instruction the cpu op's multiply-adds run on (kernels/_peak.py): 'int8' for GGUF
    blocks with int8 dots where the tile GEMM has VNNI, 'bf16' for bf16 experts on vdpbf16ps,
    else 'fp32' (FMAs, BLAS)."""
    from freetoken.kernels._isa import bf16_dots
    from freetoken.kernels.qgemm import fast_here
    if args.op in ("linear", "experts") and _has_int8_dots(args.dtype) and args.dots == "int8" and fast_here():
        return "int8"
    if args.op == "experts" and args.dtype == "bf16" and args.dots == "int8" and bf16_dots():
        return "bf16"
    return "fp32"


# --- check -----------------------------------------------------------------------------------

def _has_int8_dots(dtype: str) -> bool:
    from freetoken.kernels.cases import BLOCK_DTYPES
    from freetoken.kernels.qformats import format_named
    return dtype in BLOCK_DTYPES and format_named(dtype).int8_dots


def check(fn, ref_fn, case, device) -> bool:
    """Run ref_fn and fn on the same inputs; one line per result array; True when all are within
    the case's tolerance (integer results must match exactly)."""
    from freetoken.kernels import cases
    expect = case.results(*cases.run(ref_fn, case, np))
    got = case.results(*cases.run(fn, case, _xp(device)))
    ok = True
    for name, ref in expect.items():
        ref = cases.to_host(ref)
        atol = case.tol[0] * (float(np.abs(ref).max()) if case.atol_of_max and ref.size else 1.0)
        line, good = compare(name, ref, cases.to_host(got[name]), atol, case.tol[1])
        print(("  PASS " if good else "  FAIL ") + line)
        ok = ok and good
    return ok


def compare(name, ref, got, atol, rtol) -> tuple[str, bool]:
    """(report line, within tolerance) for one result array."""
    if ref.shape != got.shape:
        return f"{name}: shape {got.shape} != ref {ref.shape}", False
    if ref.size == 0:
        return f"{name}: empty", True
    if ref.dtype.kind in "iu" and ref.dtype.itemsize > 2:
        bad = np.argwhere(ref != got)
        if not len(bad):
            return f"{name}: all {ref.size} equal", True
        at = tuple(int(i) for i in bad[0])
        return f"{name}: {len(bad)} of {ref.size} differ; first at {at}: ref {ref[at]}, got {got[at]}", False
    if ref.dtype == np.uint16:                        # bf16 bits: compare the values
        from freetoken.kernels._bf16 import to_f32
        ref, got = to_f32(ref), to_f32(got)
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    err = np.where(np.isnan(ref) & np.isnan(got), 0.0, np.abs(got - ref))
    err = np.where(np.isnan(err), np.inf, err)
    rel = err / np.maximum(np.abs(ref), np.finfo(np.float32).tiny)
    worst = np.unravel_index(int(np.argmax(err - (atol + rtol * np.abs(ref)))), ref.shape)
    wa = np.unravel_index(int(np.argmax(err)), ref.shape)
    wr = np.unravel_index(int(np.argmax(rel)), ref.shape)
    good = bool(err[worst] <= atol + rtol * abs(ref[worst]))
    return (f"{name}: max abs {err[wa]:.3g} at {_ix(wa)} (ref {ref[wa]:.6g}, got {got[wa]:.6g}); "
            f"max rel {rel[wr]:.3g} at {_ix(wr)}; tol atol {atol:g} rtol {rtol:g}"), good


def _ix(index):
    return tuple(int(i) for i in index)


def _xp(device):
    return load_cupy() if device == "cuda" else np


# --- bench -----------------------------------------------------------------------------------

def bench(fn, case, device, iters, kind="fp32") -> None:
    """Time fn; bandwidth and FLOP/s against the device's peaks (on the CPU: measured, the FLOP/s
    one for the instruction `kind` the op multiplies with)."""
    sec = time_gpu(fn, case, iters) if device == "cuda" else time_cpu(fn, case, iters)
    gbs, tfs = case.nbytes / sec / 1e9, case.flops / sec / 1e12
    peak_gbs, peak_tfs, what = gpu_peaks() if device == "cuda" else cpu_peaks(kind)
    print(f"  time {sec * 1e6:.2f} us/call (mean of {iters}"
          f"{' in one CUDA graph' if device == 'cuda' else ''})")
    print(f"  {gbs:.1f} GB/s of {case.nbytes / 1e6:.3g} MB moved" + _share(gbs, peak_gbs, "GB/s"))
    if case.flops:
        print(f"  {tfs:.3f} TFLOP/s of {case.flops / 1e9:.3g} GFLOP" + _share(tfs, peak_tfs, "TFLOP/s"))
    print(f"  peaks: {what}")


def _share(value, peak, unit):
    return f" = {value / peak:.0%} of {peak:.4g} {unit}" if peak else ""


def time_gpu(fn, case, iters) -> float:
    """Seconds per call: ``iters`` calls captured into one CUDA graph (launch overhead out),
    replayed once to warm up, then timed with events."""
    cupy = load_cupy()
    from freetoken.kernels import cases
    ins, out = cases.run(fn, case, cupy)         # compiles the module outside the capture
    call = (lambda: fn(*ins, out)) if out is not None else (lambda: fn(*ins))
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(iters):
            call()
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / iters


def time_cpu(fn, case, iters) -> float:
    from freetoken.kernels import cases
    ins, out = cases.run(fn, case, np)            # warm-up: numba compiles on first call
    call = (lambda: fn(*ins, out)) if out is not None else (lambda: fn(*ins))
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def gpu_peaks() -> tuple[float | None, float | None, str]:
    """(GB/s, fp32 TFLOP/s, description) from the device's attributes: DRAM bandwidth is
    2 transfers/clock x memory clock x bus width; fp32 is SMs x FMA lanes x 2 x SM clock."""
    cupy = load_cupy()
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device().id

    def attr(name, number):       # CUDA 13 dropped the clock fields of cudaDeviceProp
        return rt.deviceGetAttribute(getattr(rt, name, number), dev)

    name = rt.getDeviceProperties(dev)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    try:
        gbs = 2 * attr("cudaDevAttrMemoryClockRate", 36) * 1e3 * attr("cudaDevAttrGlobalMemoryBusWidth", 37) / 8 / 1e9
    except Exception:
        gbs = None
    cc = (attr("cudaDevAttrComputeCapabilityMajor", 75), attr("cudaDevAttrComputeCapabilityMinor", 76))
    lanes = 64 if cc == (8, 0) else 128           # fp32 lanes per SM: A100 64, sm_86+ / H100 128
    try:
        tfs = attr("cudaDevAttrMultiProcessorCount", 16) * lanes * 2 * attr("cudaDevAttrClockRate", 13) * 1e3 / 1e12
    except Exception:
        tfs = None
    peak = f"{gbs:.0f} GB/s DRAM" if gbs else "DRAM peak unknown"
    return gbs, tfs, f"{name} (sm_{cc[0]}{cc[1]}): {peak}, {tfs or 0:.1f} TFLOP/s fp32 (no tensor cores)"


def cpu_peaks(kind="fp32") -> tuple[float, float | None, str]:
    """(GB/s, TFLOP/s, description), both measured on numba's threads: a parallel read of 256 MB,
    and the multiply-add instruction `kind` (kernels/_peak.py; none for the AMX tiles)."""
    from freetoken.kernels._isa import amx_int8, describe
    from freetoken.kernels._membw import measure_read_bandwidth
    from freetoken.kernels._peak import measure_peak, what_runs
    gbs = measure_read_bandwidth(nbytes=256 << 20, repeats=3)
    if kind == "int8" and amx_int8():
        tfs, compute = None, "compute peak of the AMX tiles not measured"
    else:
        tfs = measure_peak(kind) / 1e12
        compute = f"{tfs:.3g} TFLOP/s measured with {what_runs(kind)} (a multiply-add is 2)"
    return gbs, tfs, f"cpu: {gbs:.1f} GB/s measured numba parallel read (256 MB), {compute}; {describe()}"
