"""Synthetic models (freetoken/models/synth.py): spec parsing, determinism, shapes, generation."""
import numpy as np
import pytest

from freetoken.config import ConfigError
from freetoken.models.synth import PRESETS, fill_bf16, parse_spec, synth_model, weight_bytes
from freetoken.kernels._bf16 import to_f32


def _arrays(weights):
    yield weights.embed
    yield weights.final_norm
    yield weights.lm_head
    for lw in weights.layers:
        yield from (lw.input_norm, lw.post_norm, lw.qkv, lw.o_proj, lw.q_norm, lw.k_norm,
                    lw.router, lw.gate_up, lw.down)


def test_tiny_is_deterministic_and_seeded():
    cfg_a, a = synth_model("tiny", None)
    cfg_b, b = synth_model("tiny", None)
    _, c = synth_model("tiny,seed=1", None)
    assert cfg_a == cfg_b
    for x, y in zip(_arrays(a), _arrays(b)):
        assert x.dtype == np.uint16 and x.flags.c_contiguous
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.layers[0].gate_up, c.layers[0].gate_up)


def test_tiny_shapes_match_the_contract():
    cfg, w = synth_model("tiny", None)
    p = PRESETS["tiny"]
    H, V, D, E, I = p.hidden, p.vocab, p.head_dim, p.experts, p.moe_intermediate
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok) == \
        (H, p.layers, E, p.top_k)
    assert cfg.moe_layers == tuple(range(p.layers)) and cfg.norm_topk_prob
    assert w.embed.shape == w.lm_head.shape == (V, H) and w.lm_head is not w.embed
    lw = w.layers[0]
    assert lw.qkv.shape == ((p.heads + 2 * p.kv_heads) * D, H)
    assert lw.o_proj.shape == (H, p.heads * D)
    assert lw.router.shape == (E, H)
    assert lw.gate_up.shape == (E, 2 * I, H) and lw.down.shape == (E, H, I)
    assert sum(a.nbytes for a in _arrays(w)) == weight_bytes(cfg)


def test_values_are_sane():
    _, w = synth_model("tiny", None)
    g = to_f32(w.layers[1].gate_up)
    assert np.isfinite(g).all() and 0.015 < g.std() < 0.04 and abs(g.mean()) < 2e-3
    rows = w.layers[1].gate_up.reshape(-1, w.layers[1].gate_up.shape[-1])
    assert len(np.unique(rows, axis=0)) == rows.shape[0]        # no two rows alike
    norms = to_f32(w.layers[0].input_norm)
    assert 0.5 < norms.mean() < 1.5
    embed = to_f32(w.embed)
    assert 4 < embed.std() / g.std() < 16                         # embed_scale 8 by default


def test_layers_and_knob_overrides():
    cfg, w = synth_model("tiny,layers=3,seed=2", None)
    assert cfg.num_layers == 3 and len(w.layers) == 3
    _, base = synth_model("tiny", None)
    _, big = synth_model("tiny,embed_scale=64,qk_scale=3", None)
    assert to_f32(big.embed).std() == pytest.approx(8 * to_f32(base.embed).std(), rel=1e-6)
    assert to_f32(big.layers[0].q_norm).mean() > 1.3 * to_f32(base.layers[0].q_norm).mean()
    cfg, _ = synth_model("tiny,positions=9000", None)           # long-context runs
    assert cfg.max_position_embeddings == 9000


@pytest.mark.parametrize("spec, match", [
    ("nope", "presets: tiny, medium, qwen3-30b-a3b"),
    ("tiny,layers=0", "layers must be >= 1"),
    ("tiny,positions=0", "positions must be >= 1"),
    ("tiny,layers=two", "layers must be a number"),
    ("tiny,depth=3", "bad option"),
    ("tiny,layers", "bad option"),
    ("tiny,embed_scale=-1", "embed_scale must be > 0"),
])
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_spec(spec)


def test_too_big_for_memory_is_a_clear_error(monkeypatch):
    import freetoken.models.synth as synth
    monkeypatch.setattr(synth, "available_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ConfigError, match=r"try synth:medium,layers=\d+"):
        synth_model("medium", None)


def test_fill_is_deterministic_for_any_length():
    for n in (1, 2, 7, 1000, (1 << 18) + 3):      # odd tails and more than one work item
        a = np.empty(n, np.uint16)
        b = np.empty(n + 4, np.uint16)
        fill_bf16(a, 99, 119 << 7)
        fill_bf16(b, 99, 119 << 7)
        np.testing.assert_array_equal(a, b[:n])    # the odd tail's Python hash matches too
        exp = (a >> 7) & 0xFF
        assert exp.min() >= 119 and exp.max() <= 122


def test_generate_on_synth_tiny():
    from freetoken import LLM, SamplingParams
    llm = LLM(model="synth:tiny", backend="cpu")
    try:
        prompt = list(range(10, 30))
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        out = llm.generate(prompt, params)[0]
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        assert all(0 <= t < PRESETS["tiny"].vocab for t in out.token_ids)
        assert llm.generate(prompt, params)[0].token_ids == out.token_ids
        assert llm.core.model_name == "synth:tiny" and llm.core.model_dir is None
    finally:
        llm.core.close()
