"""``python -m freetoken kernel OP --check/--bench`` on a machine without a GPU: the cpu version
runs against ref, the report says so, and a mismatch is reported with its index."""
import subprocess
import sys

import numpy as np
import pytest

from freetoken.cli import main
from freetoken.commands.kernel import compare, parse_dims
from freetoken.kernels.qformats import format_named


def test_module_entry_point_checks_rms_norm():
    proc = subprocess.run([sys.executable, "-m", "freetoken", "kernel", "rms_norm", "--check",
                           "--shape", "R=3,H=96", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rms_norm [R=3 H=96] dtype bf16: rms_norm.cpu" in proc.stdout
    assert "PASS out: max abs" in proc.stdout


@pytest.mark.parametrize("op,shape,dtype", [
    ("embedding", "T=5,H=64,V=100", "bf16"),
    ("add_rms_norm", "R=3,H=33", "f32"),
    ("kv_write", "T=3,G=2,D=16,N=9", "bf16"),
    ("router", "T=3,E=40,k=4", "f32"),
    ("sampling", "B=5,V=1000", "f32"),
    ("penalties", "B=3,V=1001,N=400", "f32"),
    ("logprobs", "B=5,V=1000,k=20", "f32"),
    ("gdn_conv", "B=3,L=5,C=40,K=4,N=7", "bf16"),
    ("gated_rms_norm", "R=5,D=72", "f32"),
    ("sigmoid_mul", "R=3,D=50,full=0", "f32"),
    ("gdn_rule", "B=3,T=5,Hk=2,Hv=4,Dk=16,Dv=24,N=5", "f32"),
    ("gdn_rule", "B=2,T=70,Hk=2,Hv=4,Dk=32,Dv=16,N=3", "f32"),
])
def test_check_passes_on_cpu(op, shape, dtype, capsys):
    assert main(["kernel", op, "--check", "--shape", shape, "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert f"{op}.cpu" in out and "PASS" in out and "FAIL" not in out


def test_bench_reports_time_and_bandwidth(capsys):
    assert main(["kernel", "rms_norm", "--bench", "--shape", "R=4,H=64", "--iters", "3",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "us/call" in out and "GB/s" in out and "PASS" not in out   # --bench alone: no check
    from freetoken.kernels._isa import host
    assert f"numba target {host()[0]}" in out and "fp32 lanes" in out   # which instructions ran


@pytest.mark.parametrize("flags,width", [({"avx512f", "avx2", "fma"}, "AVX-512"), ({"avx2", "fma"}, "AVX2+FMA"),
                                         ({"sse4.2"}, "SSE")])
def test_vector_width_follows_the_cpu_features(flags, width):
    from freetoken.kernels._isa import vector_width
    assert vector_width(flags).startswith(width)


def test_describe_names_the_dot_product_instructions_present(monkeypatch):
    from freetoken.kernels import _isa
    monkeypatch.setattr(_isa, "host", lambda: ("sapphirerapids", frozenset({"avx512f", "avx512bf16", "amx-int8"})))
    line = _isa.describe()
    assert line.startswith("numba target sapphirerapids, AVX-512") and "AVX512-BF16" in line \
        and "AMX-INT8" in line and "VNNI" not in line and "unused" in line and "int8 dots by widening" in line
    monkeypatch.setattr(_isa, "host", lambda: ("haswell", frozenset({"avx2", "fma"})))
    assert _isa.describe() == ("numba target haswell, AVX2+FMA (8 fp32 lanes), fp32 FMA, "
                               "int8 dots by AVX2 pmaddubsw+pmaddwd, quantized prefill by dequantize + fp32 "
                               "BLAS (no vpdpbusd for the int8 tile GEMM), bf16 experts' prefill widened "
                               "to fp32 for BLAS, decode by fp32 FMAs, decode weight rows asked for ahead")
    monkeypatch.setattr(_isa, "host", lambda: ("znver4", frozenset({"avx512f", "avx512vl", "avx512vnni"})))
    assert "int8 dots by VNNI vpdpbusd, quantized prefill by int8 tile GEMM, 512-bit" in _isa.describe()
    assert "unused" not in _isa.describe()
    monkeypatch.setattr(_isa, "host", lambda: ("znver4", frozenset({"avx512f", "avx512vl", "avx512vnni", "avx512bf16"})))
    assert "bf16 experts' prefill by vdpbf16ps tiles, decode by vdpbf16ps row dots (AVX512-BF16)" in _isa.describe()
    assert "unused" not in _isa.describe() and "left to the hardware prefetchers (AMD Zen)" in _isa.describe()
    amx = frozenset({"avx512f", "avx512vl", "avx512vnni", "amx-int8", "amx-tile", "amx-bf16"})
    monkeypatch.setattr(_isa, "host", lambda: ("sapphirerapids", amx))
    monkeypatch.setattr(_isa, "amx_int8", lambda: True)                 # Linux granted the tiles
    line = _isa.describe()
    assert "quantized prefill by int8 tile GEMM on AMX-INT8 tiles" in line, line
    assert line.endswith("present but unused: AMX-BF16 tiles"), line
    monkeypatch.setattr(_isa, "amx_int8", lambda: False)                # not granted, or VNNI_TILES=1
    assert "AMX-BF16 tiles, AMX-INT8 tiles" in _isa.describe()
    monkeypatch.setattr(_isa, "host", lambda: ("alderlake", frozenset({"avx2", "fma", "avxvnni"})))
    assert "quantized prefill by int8 tile GEMM, 256-bit vpdpbusd" in _isa.describe()


@pytest.mark.parametrize("op,shape,dtype,dots", [
    ("linear", "T=2,K=512,M=40", "q4_k", "int8"), ("linear", "T=1,K=256,M=33", "q6_k", "f32"),
    ("experts", "T=3,H=256,I=256,S=5,k=2", "q8_0", "int8"), ("experts", "T=1,H=256,I=256,S=4,k=2", "q5_k", "int8"),
    ("linear", "T=2,K=256,M=16", "q4_0", "int8"), ("embedding", "T=3,H=256,V=20", "q6_k", "int8"),
    ("linear", "T=40,K=512,M=24", "q6_k", "int8"), ("experts", "T=80,H=256,I=256,S=4,k=2", "q4_k", "int8")])
def test_quantized_weights_check_and_bench_name_the_dots(op, shape, dtype, dots, capsys):
    """--dtype a block format: random blocks; --dots picks the linear / experts dots on both ref
    and cpu (where the format has int8 ones), and the bench line names the instructions; the
    last two shapes have tokens enough for prefill's path (the int8 tile GEMM on VNNI)."""
    assert main(["kernel", op, "--check", "--bench", "--shape", shape, "--dtype", dtype, "--dots", dots,
                 "--iters", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    int8_format = format_named(dtype).int8_dots and op != "embedding"
    assert (f"dtype {dtype}, {dots} dots: {op}.cpu" in out) == int8_format, out
    assert "PASS" in out and "FAIL" not in out and "int8 dots by " in out


def test_a_quantized_dtype_for_an_op_without_weights_is_refused(capsys):
    assert main(["kernel", "rms_norm", "--dtype", "q4_k", "--device", "cpu"]) == 1
    assert "only embedding, linear, experts take one" in capsys.readouterr().err


def test_bad_shape_is_an_error():
    assert main(["kernel", "rms_norm", "--shape", "Q=3"]) == 1
    with pytest.raises(ValueError):
        parse_dims("T=x")


def test_compare_reports_worst_index():
    ref = np.zeros((3, 4), np.float32)
    got = ref.copy()
    got[2, 1] = 0.5
    line, ok = compare("y", ref, got, 1e-3, 1e-3)
    assert not ok and "max abs 0.5 at (2, 1)" in line
    line, ok = compare("ids", np.arange(4, dtype=np.int32), np.array([0, 1, 5, 3], np.int32), 0, 0)
    assert not ok and "1 of 4 differ; first at (2,): ref 2, got 5" in line


def test_attention_on_cpu_says_its_decode_path(capsys):
    """The decode attention report names the path that ran (vector blocks at rep 4, D 64)."""
    assert main(["kernel", "attention", "--check", "--device", "cpu", "--shape", "B=2,C=300,Hq=8,G=2,D=64"]) == 0
    out = capsys.readouterr().out
    assert "decode attention: scores 4 heads x 4 slots a shuffle tree; weighted V rows 4 heads x 64" in out
    assert "PASS" in out and "FAIL" not in out


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["embedding", "rms_norm", "add_rms_norm", "rope", "linear", "kv_write",
                                "attention", "router", "experts", "sampling", "penalties",
                                "logprobs", "gdn_conv", "gdn_rule", "gated_rms_norm", "sigmoid_mul"])
def test_every_op_passes_on_the_device(op):
    """`kernel OP --device cuda --check` at each op's default shape (a GPU, or the emulated one)."""
    proc = subprocess.run([sys.executable, "-m", "freetoken", "kernel", op, "--device", "cuda",
                           "--check"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{op}.gpu" in proc.stdout and "PASS" in proc.stdout and "FAIL" not in proc.stdout


@pytest.mark.parametrize("op,shape,dtype,kind", [
    ("linear", "T=40,K=512,M=24", "q4_k", "int8"), ("experts", "T=40,H=256,I=256,S=4,k=2", "bf16", "bf16"),
    ("linear", "T=8,K=256,M=16", "f32", "fp32")])
def test_bench_gives_the_share_of_the_compute_peak_of_the_instruction_that_ran(op, shape, dtype, kind, capsys):
    """The FLOP/s line is a share of a peak measured on the instruction the op multiplies with
    (kernels/_peak.py): VNNI's int8 dots for GGUF blocks, vdpbf16ps for bf16 experts, else FMAs;
    where the CPU lacks one, the op's own fallback and the peak of what it runs instead."""
    from freetoken.kernels import _peak
    from freetoken.kernels._isa import amx_int8, bf16_dots
    from freetoken.kernels.qgemm import fast_here
    kind = {"int8": "int8" if fast_here() else "fp32", "bf16": "bf16" if bf16_dots() else "fp32"}.get(kind, kind)
    assert main(["kernel", op, "--bench", "--shape", shape, "--dtype", dtype, "--iters", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    flops_line = next(line for line in out.splitlines() if "TFLOP/s of" in line)
    if kind == "int8" and amx_int8():
        assert "compute peak of the AMX tiles not measured" in out and "% of" not in flops_line
    else:
        assert f"TFLOP/s measured with {_peak.what_runs(kind)}" in out and "% of" in flops_line
