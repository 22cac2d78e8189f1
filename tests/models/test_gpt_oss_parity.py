"""gpt-oss (GptOssForCausalLM) against transformers 5.25 (fixtures: tests/fixtures/hf/gpt_oss/,
made by tests/fixtures/make_gpt_oss_fixtures.py): fp32, bf16 and MXFP4-expert variants of a 4-layer model whose sliding layers' window (6)
is shorter than the prompt, with large sinks, non-zero biases everywhere and experts whose clamped
SwiGLU hits its limit on both sides.

Tolerances as tests/models/test_hf_parity.py: fp32 logits to 2e-4 and the 32 greedy tokens exactly;
bf16 logits to 0.5 with the argmax agreeing where transformers' own top-2 margin exceeds 1.0.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from freetoken import LLM, SamplingParams
from freetoken.config import ConfigError, EngineConfig
from freetoken.engine.plan import DeviceFacts, make_plan
from freetoken.models.hf_config import read_model_config

from tests.models.test_hf_parity import assert_fp32_parity, teacher_forced_logits

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "gpt_oss"


def run(variant: str, backend: str, moe_backend: str = "fused", **kw):
    d = FIXTURE / variant
    exp = np.load(d / "expected.npz")
    llm = LLM(str(d), backend=backend, moe_backend=moe_backend, **kw)
    assert (llm.core.plan.compute, llm.core.plan.moe.backend) == (backend, moe_backend)
    ids = np.concatenate([exp["prompt_ids"], exp["greedy_ids"][:-1]])
    return llm, exp, teacher_forced_logits(llm, ids)


# the expert cache: 8 of the 32 experts' slots, the prompt through the cache too (prefill-decode 0
# streams it through the slot pool instead), one sequence so that offload's 8 slots hold a step
CACHE = dict(moe_cache_rate=0.25, moe_prefill_decode_tokens=0, max_running_requests=1)
MOE = {"fused": {}, "cpu": {}, "offload": CACHE, "hybrid": dict(moe_fetch_fraction=0.3, **CACHE)}
CUDA = [pytest.param("cuda", m, marks=pytest.mark.gpu, id=f"cuda-{m}") for m in MOE]


@pytest.mark.parametrize("variant", ["fp32", "mxfp4"])
@pytest.mark.parametrize("backend,moe_backend", [("ref", "fused"), ("cpu", "fused"), ("cpu", "cpu"),
                                                 ("cpu", "offload"), ("cpu", "hybrid"), *CUDA])
def test_fp32_logits_and_greedy_tokens(variant, backend, moe_backend):
    """fp32, and the hub's layout (MXFP4 experts kept in their blocks, the rest fp32 here) against
    transformers' own MXFP4 reading: the blocks' values are exact, so the fp32 tolerance holds with
    fp32 dots and an fp32 KV cache (the defaults for a quantized checkpoint round activations and KV).
    cuda (a real GPU, or the emulated device): the attention kernels with sinks and windows; fused:
    every expert on the GPU (MXFP4 in its blocks, cuda/experts_quant.cu) with its biases; cpu: the
    staged CPU branch with host copies of the biases; offload and hybrid: the biases gathered by
    slot for the cache's call (and by expert for hybrid's CPU pairs)."""
    llm, exp, logits = run(variant, backend, moe_backend, cpu_dots="f32", kv_dtype="float32", **MOE[moe_backend])
    assert_fp32_parity(llm, exp, logits)
    if moe_backend in ("offload", "hybrid"):        # the cache really missed, and hybrid ran some on the CPU
        total = llm.core.moe.stats()["total"]
        assert total["misses"] > 0 and (total["cpu_execs"] > 0) == (moe_backend == "hybrid"), total


@pytest.mark.parametrize("backend", ["ref", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_logits_close(backend):
    _, exp, logits = run("bf16", backend)
    logits = logits[len(exp["prompt_ids"]) - 1:]
    np.testing.assert_allclose(logits, exp["step_logits"], atol=0.5, rtol=0)
    sure = exp["step_top2_margin"] > 1.0
    assert (logits.argmax(1)[sure] == exp["step_logits"].argmax(1)[sure]).all()


def test_mxfp4_with_the_default_roundings_follows_its_spec_and_stays_near_transformers():
    """The defaults for a quantized checkpoint (int8 dots, bf16 KV) round activations: cpu follows
    ref's rounded spec closely, and both stay within the bf16 tolerance of transformers."""
    logits = {}
    for backend in ("ref", "cpu"):
        llm, exp, logits[backend] = run("mxfp4", backend)
        assert llm.core.config.cpu_dots == "int8" and llm.core.plan.kv_dtype == "bfloat16"
    np.testing.assert_allclose(logits["cpu"], logits["ref"], atol=2e-3, rtol=0)
    steps = logits["cpu"][len(exp["prompt_ids"]) - 1:]
    np.testing.assert_allclose(steps, exp["step_logits"], atol=0.5, rtol=0)
    sure = exp["step_top2_margin"] > 1.0
    assert (steps.argmax(1)[sure] == exp["step_logits"].argmax(1)[sure]).all()


def test_chunked_prefill_over_a_cached_prefix_crosses_the_window():
    """Chunks of 5 tokens: every sliding layer's window (6) reaches back into the chunk before."""
    exp = np.load(FIXTURE / "fp32" / "expected.npz")
    llm = LLM(str(FIXTURE / "fp32"), backend="cpu", chunked_prefill_size=5)
    out = llm.generate([exp["prompt_ids"].tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == exp["greedy_ids"].tolist()


def test_the_config_reads_what_transformers_wrote():
    cfg = read_model_config(FIXTURE / "fp32")
    written = json.loads((FIXTURE / "fp32" / "config.json").read_text())
    assert cfg.sliding_layers == (0, 2) and cfg.sliding_window == written["sliding_window"] == 6
    assert [cfg.window(i) for i in range(4)] == [6, 0, 6, 0]
    assert cfg.glu == (1.702, 7.0) and cfg.expert_bias and cfg.attention_sinks
    assert cfg.moe_intermediate_size == written["intermediate_size"] and cfg.norm_topk_prob
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0


def test_auto_takes_the_gpu_and_fused_when_every_expert_fits():
    cfg = read_model_config(FIXTURE / "fp32")
    plan = make_plan(cfg, EngineConfig(model=str(FIXTURE / "fp32")), GPU)
    assert plan.compute == "cuda" and plan.moe.backend == "fused"


def test_auto_takes_the_expert_cache_when_the_experts_do_not_fit():
    """As for a Qwen model: gpt-oss-120b's ~60 GB of experts on a 24 GB GPU go through the cache."""
    from dataclasses import replace
    from freetoken.models.hf_config import model_config_from_dict
    from freetoken.models.synth_gpt_oss import PRESETS
    cfg = model_config_from_dict(PRESETS["gpt-oss-120b"].hf_config())
    plan = make_plan(cfg, EngineConfig(model="synth:gpt-oss-120b"), replace(GPU, free_device_bytes=24 << 30))
    assert plan.compute == "cuda" and plan.moe.backend in ("offload", "hybrid") and plan.moe.slots > 0, plan.decisions


GPU = DeviceFacts(gpu_missing=None, gpu_name="a GPU", free_device_bytes=80 << 30)


def test_a_trimmed_config_gets_gpt_oss_defaults_not_qwen_ones():
    """Keys a config.json may leave out take transformers' GptOssConfig defaults (window 128, eps
    1e-5, head_dim 64, YaRN over theta 150000), not the shared ones."""
    from freetoken.models.hf_config import model_config_from_dict
    from freetoken.models.rope_freqs import attention_factor
    written = json.loads((FIXTURE / "fp32" / "config.json").read_text())
    for key in ("sliding_window", "rms_norm_eps", "head_dim", "rope_parameters", "layer_types"):
        written.pop(key)
    cfg = model_config_from_dict(written)
    assert (cfg.sliding_window, cfg.rms_norm_eps, cfg.head_dim, cfg.rope_theta) == (128, 1e-5, 64, 150000.0)
    assert cfg.sliding_layers == (0, 2) and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert attention_factor(cfg) == pytest.approx(0.1 * np.log(32) + 1)


def test_qwen3_moe_with_yarn_scales_its_scores_and_a_partial_rotary_one_is_refused():
    """A Qwen3-MoE config with YaRN (Qwen's long-context recipe): the model's softmax scale carries
    the attention factor squared (transformers scales cos and sin); a GDN model's partial rotary
    dims with YaRN are refused by name rather than run with the factor on every dim."""
    from freetoken.models.hf_config import model_config_from_dict
    from freetoken.models.qwen3_moe import Qwen3Moe
    from freetoken.models.rope_freqs import attention_factor
    qwen = json.loads((FIXTURE.parent / "qwen3moe_norm" / "fp32" / "config.json").read_text())
    qwen["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = model_config_from_dict(qwen)
    assert attention_factor(cfg) == pytest.approx(0.1 * np.log(4) + 1)
    ops = type("Ops", (), {"to_device": staticmethod(lambda a: a)})
    assert Qwen3Moe(cfg, None, ops, None, None).scale == pytest.approx(cfg.head_dim ** -0.5 * attention_factor(cfg) ** 2)
    hybrid = json.loads((FIXTURE.parent / "qwen3next" / "fp32" / "config.json").read_text())
    hybrid["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match="YaRN rope with a partial rotary dimension"):
        model_config_from_dict(hybrid)
