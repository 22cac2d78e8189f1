"""--quantize-experts: a dense checkpoint's experts quantized at load (models/requantize.py), through
the CLI and the Python API, every MoE backend, the error logged once, bad values refused."""
import subprocess
import sys

import numpy as np
import pytest

from freetoken import LLM, SamplingParams
from freetoken.config import ConfigError
from freetoken.kernels.qformats import dequantize_ref, format_of
from freetoken.models.demo import write_random_model

PROMPT = list(range(5, 29))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("rq"), hidden=128, moe_intermediate=128)


@pytest.fixture(scope="module")
def model_256(tmp_path_factory):
    """Rows of 256 values: whole Q4_K blocks."""
    return write_random_model(tmp_path_factory.mktemp("rq256"), hidden=256, moe_intermediate=256)


@pytest.mark.parametrize("fmt, tol, which", [("q8_0", 0.01, "model_dir"), ("fp8", 0.05, "model_dir"),
                                             ("q4_k", 0.1, "model_256")])
def test_experts_become_blocks_close_to_the_dense_weights(request, fmt, tol, which):
    model_dir = request.getfixturevalue(which)
    dense, quant = LLM(str(model_dir), backend="cpu"), LLM(str(model_dir), backend="cpu", quantize_experts=fmt)
    cfg = quant.core.model_config
    for i in cfg.moe_layers:
        lw, ref = quant.core.weights.layers[i], dense.core.weights.layers[i]
        assert format_of(lw.gate_up).name == {"q8_0": "q8_0", "q4_k": "q4_k", "fp8": "fp8_b128"}[fmt]
        want = (ref.gate_up.astype(np.uint32) << 16).view(np.float32)       # bf16 bits -> f32
        assert np.sqrt(np.mean((dequantize_ref(lw.gate_up) - want) ** 2) / np.mean(want ** 2)) < tol
    dense.core.close(), quant.core.close()
    tokens = {}
    for moe in ("fused", "cpu", "hybrid"):
        extra = dict(moe_cache_rate=0.5) if moe == "hybrid" else {}
        llm = LLM(str(model_dir), backend="cpu", quantize_experts=fmt, moe_backend=moe, **extra)
        try:
            tokens[moe] = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        finally:
            llm.core.close()
    assert tokens["cpu"] == tokens["fused"] == tokens["hybrid"]


def test_the_cli_logs_the_quantization_once_and_refuses_a_bad_format(model_dir):
    run = subprocess.run([sys.executable, "-m", "freetoken", "generate", "--model", str(model_dir), "--backend", "cpu",
                          "--quantize-experts", "q8_0", "--prompt", "import os", "--max-tokens", "3", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("experts quantized to q8_0 at load") == 1 and "relative RMS error" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "freetoken", "generate", "--model", str(model_dir),
                          "--quantize-experts", "q3", "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--quantize-experts" in bad.stderr and "Traceback" not in bad.stderr


def test_rows_that_are_not_whole_blocks_are_one_error(tmp_path):
    d = write_random_model(tmp_path, hidden=96, heads=2, kv_heads=1, head_dim=48, moe_intermediate=64)
    with pytest.raises(ConfigError, match="--quantize-experts fp8: expert rows of 96 values"):
        LLM(str(d), backend="cpu", quantize_experts="fp8")


@pytest.mark.gpu
def test_the_cuda_backend_runs_the_quantized_experts(model_dir):
    """On cuda the quantized experts stay quantized (the slots hold their blocks) and give the cpu
    backend's tokens."""
    tokens = []
    for backend in ("cpu", "cuda"):
        llm = LLM(str(model_dir), backend=backend, quantize_experts="q8_0", moe_backend="hybrid",
                  moe_cache_rate=0.5, cpu_dots="f32")       # the GPU's fp32 numerics on the CPU too
        try:
            if backend == "cuda":
                assert llm.core.moe.pool[0].dtype == np.uint8
            tokens.append(llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids)
        finally:
            llm.core.close()
    assert tokens[0] == tokens[1]
