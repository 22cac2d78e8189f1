"""Decode kernels on the GPU against the device's measured copy bandwidth; pairs:
cuda/linear.cu, cuda/experts.cu, cuda/attention.cu (freetoken/kernels/{linear,experts,attention}.py).

    python bench/kernels/gpu_decode_kernels.py [--iters 50] [--out bench/results/gpu_decode_kernels.json]

Decode is bandwidth bound: each call must read its weights (or KV rows) once. Shapes are
Qwen3-30B-A3B's (H 2048, 32/4 heads x 128, 128 experts top-8, I 768, V 151936), bf16. Weights are
cycled through enough copies to exceed the 60 MB L2, so every call reads from HBM; `iters` calls
are captured into one CUDA graph so Python launch overhead is out, then timed with events.
GB/s counts the bytes a call must read once; "% copy" compares it with a device-to-device copy
(read + write bytes) measured in the same run.
"""
import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from freetoken.kernels import attention, experts, linear  # noqa: E402
from freetoken.cupy_loader import cupy as load_cupy

COLD_BYTES = 256 << 20  # weight copies cycled per timing: over 4x the H200's L2


def time_graph(calls, iters):
    """Seconds per call: calls(i) launches call i; iters of them in one graph, replayed 3 times."""
    cp = load_cupy()
    for i in range(2):
        calls(i)                                   # compile, size scratch, outside the capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for i in range(iters):
            calls(i)
        graph = stream.end_capture()
        graph.launch(stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(3):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / (3 * iters)


def copy_bandwidth(nbytes=1 << 30):
    """Device copy GB/s counting bytes read plus bytes written."""
    cp = load_cupy()
    src, dst = cp.ones(nbytes // 4, cp.float32), cp.empty(nbytes // 4, cp.float32)
    sec = time_graph(lambda i: dst.__setitem__(Ellipsis, src), 10)
    return 2 * nbytes / sec / 1e9


def bf16(shape):
    """Random positive bf16 bits in [2^-7, 1): no overflow in K <= 1e5 dot products. Drawn on
    the device: the expert banks are gigabytes."""
    cp = load_cupy()
    return cp.random.randint(0x3c00, 0x3f80, size=shape, dtype=cp.int32).astype(cp.uint16)


def copies(make, nbytes):
    """As many independent copies of make() as keep COLD_BYTES in flight (at least 2)."""
    return [make() for _ in range(max(2, -(-COLD_BYTES // max(nbytes, 1))))]


def bench_linear(rng, T, K, M, iters):
    cp = load_cupy()
    ws = copies(lambda: bf16((M, K)), 2 * M * K)
    x, out = cp.asarray(rng.standard_normal((T, K), dtype=np.float32)), cp.empty((T, M), cp.float32)
    sec = time_graph(lambda i: linear.gpu(x, ws[i % len(ws)], out), iters)
    return sec, 2 * M * K + 4 * T * (K + M)


def bench_experts(rng, T, H, I, E, k, iters):
    cp = load_cupy()
    banks = copies(lambda: (bf16((E, 2 * I, H)), bf16((E, H, I))), 6 * E * H * I)
    routes = [np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32) for _ in range(8)]
    ids = [cp.asarray(r) for r in routes]
    x = cp.asarray(rng.standard_normal((T, H), dtype=np.float32))
    w, out = cp.asarray(rng.random((T, k), dtype=np.float32)), cp.empty((T, H), cp.float32)
    sec = time_graph(lambda i: experts.gpu(x, ids[i % 8], w, *banks[i % len(banks)], out), iters)
    unique = np.mean([np.unique(r).size for r in routes])
    return sec, unique * 6 * H * I + 4 * T * 2 * H


def bench_attention(rng, B, C, Hq, G, D, iters):
    cp = load_cupy()
    N = B * C
    kvs = copies(lambda: (bf16((N, G, D)), bf16((N, G, D))), 4 * N * G * D)
    table = cp.asarray(rng.permutation(N).astype(np.int32).reshape(B, C))
    seq, pos = cp.arange(B, dtype=cp.int32), cp.full(B, C - 1, cp.int32)
    q, out = cp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)), cp.empty((B, Hq, D), cp.float32)
    sec = time_graph(lambda i: attention.gpu(q, *kvs[i % len(kvs)], table, seq, pos,
                                             D ** -0.5, out), iters)
    return sec, 4 * N * G * D + 4 * N + 8 * B * Hq * D


def cases():
    H, Hq, G, D, I, E, k, V = 2048, 32, 4, 128, 768, 128, 8, 151936
    for T in (1, 4):
        yield "linear qkv", f"T{T} K{H} M{(Hq + 2 * G) * D}", bench_linear, (T, H, (Hq + 2 * G) * D)
        yield "linear o_proj", f"T{T} K{Hq * D} M{H}", bench_linear, (T, Hq * D, H)
        yield "linear lm_head", f"T{T} K{H} M{V}", bench_linear, (T, H, V)
        yield "experts", f"T{T} H{H} I{I} E{E} k{k}", bench_experts, (T, H, I, E, k)
    for B in (1, 4):
        for C in (1024, 8192, 32768):
            yield "attention decode", f"B{B} C{C} Hq{Hq} G{G} D{D}", bench_attention, (B, C, Hq, G, D)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50, help="calls per captured graph (default 50)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_decode_kernels.json"))
    args = ap.parse_args(argv)
    cp = load_cupy()
    rng = np.random.default_rng(0)
    copy_gbs = copy_bandwidth()
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{device}: device copy {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'kernel':<18} {'shape':<26} {'us/call':>9} {'GB/s':>8} {'% copy':>7}")
    rows = []
    for name, shape, fn, dims in cases():
        sec, nbytes = fn(rng, *dims, args.iters)
        gbs = nbytes / sec / 1e9
        rows.append(dict(kernel=name, shape=shape, us=sec * 1e6, bytes=int(nbytes), gbs=gbs,
                         copy_share=gbs / copy_gbs))
        print(f"{name:<18} {shape:<26} {sec * 1e6:9.2f} {gbs:8.0f} {gbs / copy_gbs:7.0%}")
        cp.get_default_memory_pool().free_all_blocks()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=device, host=platform.node(),
                                              copy_gbs=copy_gbs, iters=args.iters, rows=rows), indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
