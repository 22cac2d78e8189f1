"""Logits and greedy tokens against Hugging Face transformers (fixtures: tests/fixtures/hf/).

Tolerances: fp32 checkpoints must match transformers' fp32 logits to 2e-4 absolute (transformers
itself is within 1e-5 of a float64 re-implementation; the rest is summation order), and the 32
greedy tokens exactly. bf16 checkpoints: transformers computes in bf16 (error up to ~0.16 against
float64) while FreeToken keeps fp32 activations (the cpu backend rounds the routed experts' inputs
to bf16 under its default --cpu-dots int8, as transformers' bf16 forward does), so logits must
agree to 0.5, and the argmax must agree wherever transformers' own top-2 margin exceeds 1.0.
"""
from pathlib import Path

import numpy as np
import pytest

from freetoken import LLM, SamplingParams
from freetoken.models.forward_batch import ForwardBatch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
CHECKPOINTS = ["qwen3moe_norm", "qwen3moe_nonorm"]


def teacher_forced_logits(llm: LLM, ids: np.ndarray) -> np.ndarray:
    """f32[T, V]: logits after every position of ids, in one prefill over the whole sequence
    (a hybrid's from a zero recurrent state in a row of its own)."""
    core = llm.core
    T = len(ids)
    slots = np.asarray(core.kv.alloc(T), dtype=np.int32)
    row = core.states.alloc() if core.states is not None else None
    hybrid = {} if row is None else dict(seq_starts=np.array([0, T], np.int32), state_slots=np.array([row], np.int32))
    try:
        batch = ForwardBatch(ids=ids.astype(np.int32), positions=np.arange(T, dtype=np.int32),
                             tok_seq=np.zeros(T, np.int32), slots=slots, slot_table=slots[None, :],
                             last_index=np.arange(T, dtype=np.int32), prefill=True, **hybrid)
        return np.asarray(core.ops.to_host(core.model.forward(batch)))
    finally:
        core.kv.free(slots.tolist())
        if row is not None:
            core.states.free(row)


def run_fixture(name: str, variant: str, backend: str):
    """(llm, expected arrays, teacher-forced logits over prompt + greedy[:-1])."""
    d = FIXTURES / name / variant
    exp = np.load(d / "expected.npz")
    llm = LLM(str(d), backend=backend, moe_backend="fused")
    ids = np.concatenate([exp["prompt_ids"], exp["greedy_ids"][:-1]])
    return llm, exp, teacher_forced_logits(llm, ids)


def assert_fp32_parity(llm, exp, logits) -> None:
    """Every position's logits within 2e-4 of transformers' fp32 ones, and its 32 greedy tokens."""
    prompt, greedy = exp["prompt_ids"], exp["greedy_ids"]
    P = len(prompt)
    np.testing.assert_allclose(logits[:P], exp["prefill_logits"], atol=2e-4, rtol=0)
    np.testing.assert_allclose(logits[P - 1:], exp["step_logits"], atol=2e-4, rtol=0)
    out = llm.generate([prompt.tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == greedy.tolist()


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_fp32_logits_and_greedy_tokens(name, backend):
    assert_fp32_parity(*run_fixture(name, "fp32", backend))


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_bf16_logits_close(name, backend):
    _, exp, logits = run_fixture(name, "bf16", backend)
    logits = logits[len(exp["prompt_ids"]) - 1:]
    np.testing.assert_allclose(logits, exp["step_logits"], atol=0.5, rtol=0)
    sure = exp["step_top2_margin"] > 1.0
    assert (logits.argmax(1)[sure] == exp["step_logits"].argmax(1)[sure]).all()


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_bf16_logits_close_with_every_prefill_expert_on_the_bf16_tiles(name, monkeypatch):
    """The bf16 tolerance again with the cpu backend's prefill experts all on the vdpbf16ps tiles
    (kernels/experts_bf16.py; the fixture's prompt gives an expert too few tokens to choose them
    by itself), or, on a CPU without AVX512-BF16, on BLAS with the same bf16 rounding."""
    from freetoken.kernels import _isa, experts, experts_bf16
    monkeypatch.setattr(experts, "BLAS_MIN_PAIRS", 0)
    tiles = []
    gemm = experts_bf16.gemm
    monkeypatch.setattr(experts_bf16, "gemm", lambda *a: tiles.append(1) or gemm(*a))
    _, exp, logits = run_fixture(name, "bf16", "cpu")
    assert bool(tiles) == _isa.bf16_dots()
    logits = logits[len(exp["prompt_ids"]) - 1:]
    np.testing.assert_allclose(logits, exp["step_logits"], atol=0.5, rtol=0)
    sure = exp["step_top2_margin"] > 1.0
    assert (logits.argmax(1)[sure] == exp["step_logits"].argmax(1)[sure]).all()


def test_chunked_prefill_over_cached_prefix_matches():
    d = FIXTURES / "qwen3moe_norm" / "fp32"
    exp = np.load(d / "expected.npz")
    llm = LLM(str(d), backend="cpu", moe_backend="fused", chunked_prefill_size=5)
    out = llm.generate([exp["prompt_ids"].tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == exp["greedy_ids"].tolist()
