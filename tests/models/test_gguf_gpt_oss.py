"""gpt-oss GGUF files made by llama.cpp's own converter (llama-cpp-python 0.3.36's vendored
convert_hf_to_gguf.py, tests/fixtures/make_gpt_oss_fixtures.py --gguf) from the HF fixtures of
tests/fixtures/hf/gpt_oss/: the same weights, so each HF variant's expected.npz is the file's
expectation (transformers 5.25), with the tolerances of test_gpt_oss_parity.py."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from freetoken import LLM
from freetoken.kernels.qformats import format_of
from freetoken.models.gguf_file import open_gguf
from freetoken.models.gguf_gpt_oss import gpt_oss_gguf_config, gpt_oss_gguf_weights
from freetoken.models.hf_config import read_model_config
from freetoken.models.weights import load_weights

from tests.models.test_hf_parity import assert_fp32_parity, teacher_forced_logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GGUF, HF = FIXTURES / "gguf", FIXTURES / "hf" / "gpt_oss"


def logits_of(variant: str, backend: str, **kw):
    exp = np.load(HF / variant / "expected.npz")
    llm = LLM(str(GGUF / f"gpt_oss-{variant}.gguf"), backend=backend, **kw)
    return llm, exp, teacher_forced_logits(llm, np.concatenate([exp["prompt_ids"], exp["greedy_ids"][:-1]]))


@pytest.mark.parametrize("backend,moe_backend", [("ref", "fused"), ("cpu", "cpu"),
                                                 pytest.param("cuda", "fused", marks=pytest.mark.gpu)])
def test_mxfp4_file_matches_transformers(backend, moe_backend):
    assert_fp32_parity(*logits_of("mxfp4", backend, moe_backend=moe_backend, cpu_dots="f32", kv_dtype="float32"))


def test_bf16_file_is_close_to_transformers_bf16():
    _, exp, logits = logits_of("bf16", "cpu")
    logits = logits[len(exp["prompt_ids"]) - 1:]
    np.testing.assert_allclose(logits, exp["step_logits"], atol=0.5, rtol=0)
    sure = exp["step_top2_margin"] > 1.0
    assert (logits.argmax(1)[sure] == exp["step_logits"].argmax(1)[sure]).all()


def test_the_file_reads_as_the_checkpoint_it_was_made_from():
    """Config from the metadata as from config.json; the converter's MXFP4 experts and the HF
    loader's re-packed ones the same bytes; biases, sinks and router identical."""
    model = open_gguf(GGUF / "gpt_oss-mxfp4.gguf")
    cfg, hf_cfg = gpt_oss_gguf_config(model), read_model_config(HF / "mxfp4")
    assert cfg == replace(hf_cfg, torch_dtype=cfg.torch_dtype)
    gguf, hf = gpt_oss_gguf_weights(model, cfg).layers, load_weights(HF / "mxfp4", hf_cfg).layers
    for a, b in zip(gguf, hf):
        assert format_of(a.gate_up).name == format_of(a.down).name == "mxfp4"
        for name in ("gate_up", "down", "gate_up_bias", "down_bias", "sinks", "qkv", "qkv_bias", "router",
                     "router_bias", "o_proj", "o_bias", "input_norm", "post_norm"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_a_harmony_vocabulary_ends_the_reply_on_return_and_call_not_on_end():
    """<|end|> closes every harmony message (the analysis one too): with <|return|> and <|call|> in
    the vocabulary it is no stop token, as llama.cpp reads such a file; elsewhere it still is."""
    import dataclasses
    from freetoken.models.gguf_tokenizer import CONTROL, gguf_tokenizer
    model = open_gguf(GGUF / "gpt_oss-mxfp4.gguf")
    tokens, types = list(model.metadata["tokenizer.ggml.tokens"]), list(model.metadata["tokenizer.ggml.token_type"])
    markers = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    for offset, marker in enumerate(markers):
        tokens[4000 + offset], types[4000 + offset] = marker, CONTROL
    ids = {m: 4000 + k for k, m in enumerate(markers)}

    def stops(vocab):
        meta = {**model.metadata, "tokenizer.ggml.tokens": vocab, "tokenizer.ggml.token_type": types}
        return set(gguf_tokenizer(dataclasses.replace(model, metadata=meta)).stop_token_ids)
    harmony = stops(tokens)
    assert {ids["<|return|>"], ids["<|call|>"]} <= harmony and ids["<|end|>"] not in harmony
    assert gguf_tokenizer(dataclasses.replace(model, metadata={**model.metadata, "tokenizer.ggml.tokens": tokens,
                                                               "tokenizer.ggml.token_type": types})).speaks_harmony
    without = [t if t not in ("<|return|>", "<|call|>") else f"[PAD{i}]" for i, t in enumerate(tokens)]
    assert ids["<|end|>"] in stops(without)
