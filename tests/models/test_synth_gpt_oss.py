"""Synthetic gpt-oss models (freetoken/models/synth_gpt_oss.py): the presets' configs at the public
geometry (without generating their weights), the MXFP4 experts' bytes and values, end to end on
the tiny preset."""
import json
from pathlib import Path

import numpy as np
import pytest

from freetoken.config import ConfigError
from freetoken.env import available_memory_bytes
from freetoken.kernels import qformats
from freetoken.models.hf_config import model_config_from_dict
from freetoken.models.synth import MXFP4_EXP, fill_mxfp4, parse_spec, synth_model, weight_bytes

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "gpt_oss" / "fp32" / "config.json"
EXPONENTS = (MXFP4_EXP, MXFP4_EXP + 3)    # the exponent bytes synth draws from


def _config(spec):
    _, shape, _ = parse_spec(spec)
    return model_config_from_dict(shape.hf_config())


@pytest.mark.parametrize("spec, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_presets_have_the_public_geometry(spec, layers, experts):
    cfg = _config(spec)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok) == \
        ("GptOssForCausalLM", 2880, layers, experts, 4)
    assert (cfg.moe_intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == \
        (2880, 64, 8, 64, 201088)
    assert cfg.window(0) == 128 and cfg.window(1) == 0 and cfg.sliding_layers == tuple(range(0, layers, 2))
    assert cfg.glu == (1.702, 7.0) and cfg.attention_sinks and cfg.expert_bias
    assert cfg.rope_theta == 150000.0 and cfg.max_position_embeddings == 131072 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "original_max_position_embeddings": 4096, "truncate": False}
    assert not cfg.tie_word_embeddings and cfg.norm_topk_prob
    # what transformers' own config.json of this geometry reads as (the fixture's, reshaped)
    written = json.loads(FIXTURE.read_text())
    written.update(hidden_size=2880, num_hidden_layers=layers, num_local_experts=experts, intermediate_size=2880,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128,
                   layer_types=[written["layer_types"][i % 2] for i in range(layers)], dtype="bfloat16")
    assert model_config_from_dict(written) == cfg


@pytest.mark.parametrize("spec", ["gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"])
def test_weight_bytes_count_mxfp4_experts_and_f32_biases(spec):
    one, two = _config(spec + ",layers=1"), _config(spec + ",layers=2")
    H, V, E, I, D = one.hidden_size, one.vocab_size, one.num_experts, one.moe_intermediate_size, one.head_dim
    qkv = (one.num_heads + 2 * one.num_kv_heads) * D
    dense = 2 * (2 * H + qkv * H + H * one.num_heads * D + E * H)
    f32 = 4 * (qkv + H + one.num_heads + E + 2 * E * I + E * H)
    experts = weight_bytes(two) - weight_bytes(one) - dense - f32
    assert experts * 32 == 3 * E * I * H * 17                   # 17 bytes per 32 values
    assert weight_bytes(one) == 2 * (2 * V * H + H) + dense + f32 + experts
    if spec == "gpt-oss-20b":                                   # the hub's files: 13.8 GB
        assert 13.5e9 < weight_bytes(_config(spec)) < 14e9


def test_tiny_weights_are_the_hub_layout_and_deterministic():
    cfg, w = synth_model("tiny-gpt-oss", None)
    _, again = synth_model("tiny-gpt-oss", None)
    _, other = synth_model("tiny-gpt-oss,seed=1", None)
    lw, E, I, H = w.layers[1], cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert lw.gate_up.shape == (E, 2 * I, H // 32, 17) and lw.down.shape == (E, H, I // 32, 17)
    assert qformats.format_of(lw.gate_up).name == qformats.format_of(lw.down).name == "mxfp4"
    values = qformats.dequantize_ref(lw.gate_up)
    assert 0.015 < values.std() < 0.04 and abs(values.mean()) < 2e-3
    arrays = [lw.qkv_bias, lw.o_bias, lw.sinks, lw.router_bias, lw.gate_up_bias, lw.down_bias]
    assert all(a.dtype == np.float32 for a in arrays) and lw.qkv.dtype == np.uint16
    assert sum(a.nbytes for a in _arrays(w)) == weight_bytes(cfg)
    for a, b in zip(_arrays(w), _arrays(again)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(lw.gate_up, other.layers[1].gate_up)
    assert not np.array_equal(lw.sinks, other.layers[1].sinks)


def _arrays(weights):
    yield from (weights.embed, weights.final_norm, weights.lm_head)
    for lw in weights.layers:
        yield from (getattr(lw, name) for name in lw.__dataclass_fields__)


def test_qk_scale_is_refused_and_the_other_options_work():
    with pytest.raises(ConfigError, match="qk_scale does not apply to gpt-oss-20b, which has no q/k norms"):
        parse_spec("gpt-oss-20b,qk_scale=2")
    cfg = _config("gpt-oss-120b,layers=3,positions=9000,embed_scale=64")
    assert cfg.num_layers == 3 and cfg.sliding_layers == (0, 2) and cfg.max_position_embeddings == 9000
    _, shape, seed = parse_spec("tiny-gpt-oss,seed=5,embed_scale=64")
    assert seed == 5 and shape.embed_scale == 64.0


def test_too_big_for_memory_suggests_layers(monkeypatch):
    import freetoken.models.synth as synth
    monkeypatch.setattr(synth, "available_memory_bytes", lambda: 4 << 30)
    with pytest.raises(ConfigError, match=r"needs 13\.8 GB .* try synth:gpt-oss-20b,layers=\d+$") as err:
        synth_model("gpt-oss-20b", None)
    fit = int(str(err.value).rsplit("=", 1)[1])                # the largest that fits, by the real bytes
    assert weight_bytes(_config(f"gpt-oss-20b,layers={fit}")) <= 0.9 * (4 << 30) \
        < weight_bytes(_config(f"gpt-oss-20b,layers={fit + 1}"))


def test_gpt_oss_20b_one_layer_has_mxfp4_experts():
    avail = available_memory_bytes()
    if avail is not None and avail < 6e9:
        pytest.skip(f"synth:gpt-oss-20b,layers=1 needs ~3 GB; {avail / 1e9:.1f} GB available")
    cfg, w = synth_model("gpt-oss-20b,layers=1", None)
    lw = w.layers[0]
    assert lw.gate_up.shape == (32, 5760, 90, 17) and lw.down.shape == (32, 2880, 90, 17)
    for bank in (lw.gate_up, lw.down):
        assert qformats.format_of(bank).name == "mxfp4"
        exponents = np.bincount(bank[..., 0].reshape(-1), minlength=256)
        assert exponents.sum() == exponents[EXPONENTS[0]:EXPONENTS[1] + 1].sum()   # all in the range
        assert exponents[EXPONENTS[0]:EXPONENTS[1] + 1].min() > 0.24 * exponents.sum()  # each about 1/4
    assert w.embed.shape == w.lm_head.shape == (201088, 2880) and w.embed.dtype == np.uint16
    assert sum(a.nbytes for a in _arrays(w)) == weight_bytes(cfg)


def test_mxfp4_fill_is_deterministic_for_any_block_count():
    for n in (1, 3, 4, 7, 2 * (1 << 15) + 3):          # tails of 1-3 bytes, more than one work item
        a, b = np.empty((n, 17), np.uint8), np.empty((n + 4, 17), np.uint8)
        fill_mxfp4(a, 99, MXFP4_EXP)
        fill_mxfp4(b, 99, MXFP4_EXP)
        np.testing.assert_array_equal(a[:, :14], b[:n, :14])      # all but a tail's bytes
        assert EXPONENTS[0] <= a[:, 0].min() and a[:, 0].max() <= EXPONENTS[1]


def _tokens(backend, **kw):
    from freetoken import LLM, SamplingParams
    llm = LLM("synth:tiny-gpt-oss", backend=backend, **kw)
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        prompt = list(range(40, 52))                   # longer than the sliding layers' window (8)
        first = llm.generate(prompt, params)[0]
        assert len(first.token_ids) == 8 and first.finish_reason == "length"
        assert llm.generate(prompt, params)[0].token_ids == first.token_ids
        return first.token_ids
    finally:
        llm.core.close()


def test_tiny_generates_deterministically_and_ref_agrees_with_cpu():
    assert all(0 <= t < 4096 for t in _tokens("cpu"))
    exact = dict(cpu_dots="f32", kv_dtype="float32")
    assert _tokens("ref", **exact) == _tokens("cpu", **exact)
