"""A Q4_0 GGUF on the cpu backend (tests/fixtures/gguf/qwen3moe_256-q4_0.gguf): its expert banks
interleaved 16 rows at a time at load (kernels/qinterleave.py, engine/build.interleaved_q4_0),
the default, against --no-cpu-interleave-q4-0 and the ref backend, through the LLM API."""
import logging

import numpy as np
import pytest
from tests.models.test_gguf import EXACT, assert_same_tokens_but_at_a_tie
from tests.models.test_hf_parity import teacher_forced_logits

from freetoken import LLM, SamplingParams
from freetoken.kernels import qgemm
from freetoken.kernels.qformats import format_of


def _run(backend, ids, prompt, **options):
    """(the expert banks' format names, teacher-forced logits, 32 greedy tokens)."""
    llm = LLM(str(EXACT["q4_0"][0]), backend=backend, moe_backend="fused", **options)
    try:
        core = llm.core
        names = {format_of(getattr(core.weights.layers[i], f)).name
                 for i in core.model_config.moe_layers for f in ("gate_up", "down", "qkv", "o_proj")}
        tokens = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
        return names, teacher_forced_logits(llm, ids), tokens
    finally:
        llm.core.close()


@pytest.fixture
def q4_0():
    exp = np.load(EXACT["q4_0"][1])
    return exp, np.concatenate([exp["prompt_ids"], exp["greedy_ids"][:-1]]), exp["prompt_ids"].tolist()


def test_the_cpu_backend_interleaves_q4_0_experts_and_keeps_their_results(q4_0, monkeypatch, caplog):
    """On a CPU with VNNI (forced here: the tile GEMM's fallback runs anywhere, exactly) the banks
    are rewritten and logged; the logits stay within fp32 sums of the file layout's (the int8
    rounding of the activation between gate_up and down may flip a value: 0.05, as
    test_int8_dots_are_the_int8_spec allows against ref) and the greedy tokens agree but at a tie."""
    monkeypatch.setattr(qgemm, "fast_here", lambda: True)
    caplog.set_level(logging.INFO, logger="freetoken")
    exp, ids, prompt = q4_0
    on = _run("cpu", ids, prompt)
    said = [r.getMessage() for r in caplog.records if "interleaved 16 rows" in r.getMessage()]
    off = _run("cpu", ids, prompt, cpu_interleave_q4_0=False)
    assert on[0] == {"q4_0x16"} and off[0] == {"q4_0"} and len(said) == 1
    P = len(prompt)
    np.testing.assert_allclose(on[1], off[1], atol=0.05, rtol=0)
    assert np.median(np.abs(on[1] - off[1])) < 1e-3
    assert_same_tokens_but_at_a_tie(on[2], off[2], exp["greedy_ids"], off[1][P - 1:])


def test_without_vnni_or_int8_dots_the_files_layout_stays(q4_0, monkeypatch, caplog):
    """No VNNI: prefill would dequantize for BLAS, so the banks stay as the file has them, and
    the log says why; likewise with --cpu-dots f32 and on the ref backend (no log: nothing to choose)."""
    caplog.set_level(logging.INFO, logger="freetoken")
    exp, ids, prompt = q4_0
    monkeypatch.setattr(qgemm, "fast_here", lambda: False)
    assert _run("cpu", ids[:8], prompt)[0] == {"q4_0"}
    monkeypatch.setattr(qgemm, "fast_here", lambda: True)
    assert _run("cpu", ids[:8], prompt, cpu_dots="f32")[0] == {"q4_0"}
    assert _run("ref", ids[:8], prompt)[0] == {"q4_0"}
    kept = [r.getMessage() for r in caplog.records if "kept in the file's layout" in r.getMessage()]
    assert len(kept) == 2 and "no VNNI" in kept[0] and "--cpu-dots f32" in kept[1]
