"""synth:SPEC written as a HF directory (freetoken/models/synth_export.py) loads back as the same
model: same config, the same bits in every weight, the same greedy tokens."""
import json

import numpy as np
import pytest

from freetoken.cli import main
from freetoken.config import ConfigError
from freetoken.models.hf_config import read_model_config
from freetoken.models.synth import synth_model
from freetoken.models.synth_export import export_synth
from freetoken.models.weights import load_weights

from tests.models.test_synth import _arrays


def test_export_loads_back_bit_for_bit(tmp_path):
    path = export_synth("tiny", tmp_path / "tiny")
    cfg, synth = synth_model("tiny", None)
    loaded_cfg = read_model_config(path)
    assert loaded_cfg == cfg
    loaded = load_weights(path, loaded_cfg)
    for a, b in zip(_arrays(synth), _arrays(loaded), strict=True):
        assert b.dtype == np.uint16
        np.testing.assert_array_equal(a, b)
    assert (path / "tokenizer.json").is_file() and not (path / "model.safetensors.index.json").exists()


def test_export_gives_the_same_greedy_tokens(tmp_path):
    from freetoken import LLM, SamplingParams
    path = export_synth("synth:tiny", tmp_path / "tiny")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [17, 400, 9, 3000, 52, 7, 1024, 88]
    tokens = []
    for model in ("synth:tiny", str(path)):
        llm = LLM(model, backend="cpu")
        tokens.append(llm.generate(prompt, params)[0].token_ids)
        llm.core.close()
    assert len(tokens[0]) == 16 and tokens[0] == tokens[1]


def test_cli_writes_shards_with_an_index(tmp_path, monkeypatch):
    import freetoken.models.synth_export as export
    monkeypatch.setattr(export, "SHARD_BYTES", 100_000)     # tiny is ~1 MB: several shards
    assert main(["demo-model", str(tmp_path / "m"), "--synth", "tiny,layers=3"]) == 0
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in index["weight_map"]
    cfg = read_model_config(tmp_path / "m")
    _, synth = synth_model("tiny,layers=3", None)
    loaded = load_weights(tmp_path / "m", cfg)
    np.testing.assert_array_equal(synth.layers[2].gate_up, loaded.layers[2].gate_up)


def test_hybrids_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="hybrid"):
        export_synth("tiny-hybrid", tmp_path / "h")


def test_a_gpt_oss_preset_exports_as_the_hub_ships_it(tmp_path):
    """MXFP4 experts as `_blocks` + `_scales` with gate and up rows interleaved, fp32 biases, bf16 the
    rest, quantization_config mxfp4: the loader reads back the same blocks and the same tokens come
    out (what llama.cpp's converter reads for the gpt-oss benchmark)."""
    from freetoken import LLM, SamplingParams
    from freetoken.models.safetensors_io import Checkpoint
    path = export_synth("tiny-gpt-oss", tmp_path / "g")
    cfg, synth = synth_model("tiny-gpt-oss", None)
    assert read_model_config(path) == cfg
    ck = Checkpoint(path)
    assert ck.stored_dtype("model.layers.0.mlp.experts.gate_up_proj_blocks") == "U8"
    assert ck.stored_dtype("model.layers.0.mlp.experts.down_proj_bias") == "F32"
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    loaded = load_weights(path, cfg)
    for a, b in zip(synth.layers, loaded.layers, strict=True):
        for name in ("gate_up", "down", "gate_up_bias", "down_bias", "qkv", "qkv_bias", "sinks", "router", "o_proj"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens = [LLM(model, backend="cpu").generate([5, 90, 300, 7], params)[0].token_ids
              for model in ("synth:tiny-gpt-oss", str(path))]
    assert tokens[0] == tokens[1]
