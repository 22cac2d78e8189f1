"""Qwen's block-FP8 checkpoints (models/fp8_weights.py): transformers on the fixtures of
tests/fixtures/hf/qwen3moe_fp8/ (made by tests/fixtures/make_fp8_fixtures.py); linears kept as FP8
row blocks compute what the same model dequantized by the spec computes, on every MoE backend;
scales in bf16 or float32; K not a multiple of 128 is widened; one clear error per bad checkpoint.

The fixtures' expected.npz is transformers 5.24's forward with every weight as its FP8 loader
dequantizes it, except the experts: its CPU dequantizer infers the tile size from the shapes
(rows // scale rows), which misplaces the scales of a partial tile (moe_intermediate_size 192:
rows 96-127 take the second tile's scale), so the experts there are the correct dequantization
(tiles of 128 from 0, as the format defines and the FP8 releases' own code does), checked in
dequantized.npz against transformers' copies of the other weights."""
import json
from pathlib import Path

import numpy as np
import pytest
from fp8_checkpoints import write_fp8_gdn_pair, write_fp8_pair
from test_hf_parity import teacher_forced_logits
from test_gguf import matches_transformers, served_name_after_two_sdk_answers

from freetoken import LLM, SamplingParams
from freetoken.config import ConfigError
from freetoken.kernels.qformats import dequantize_ref, format_of
from freetoken.models.hf_config import read_model_config
from freetoken.models.safetensors_io import WeightsError, save_safetensors
from freetoken.models.weights import load_weights

PROMPT = list(range(5, 37))
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3moe_fp8"


@pytest.mark.parametrize("backend", ["ref", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("scales", ["bf16_scales", "f32_scales"])
def test_fp8_checkpoints_match_transformers(scales, backend):
    matches_transformers(FIXTURES / scales, np.load(FIXTURES / scales / "expected.npz"), backend)


@pytest.mark.parametrize("scales", ["bf16_scales", "f32_scales"])
def test_dequantization_is_transformers_bit_for_bit(scales):
    """q_proj (whole tiles, kept in blocks) as transformers holds it; the experts as the format
    defines them (I = 192 is not a multiple of 128: the banks are widened at load)."""
    want = np.load(FIXTURES / scales / "dequantized.npz")
    path = FIXTURES / scales
    w = load_weights(path, read_model_config(path))
    q = want["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(dequantize_ref(w.layers[0].qkv)[:q.shape[0]], q)
    gate_up, down = w.layers[1].gate_up, w.layers[1].down
    gate = want["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert format_of(w.layers[0].qkv).name == "fp8_b128" and gate_up.dtype == down.dtype == np.float32
    np.testing.assert_array_equal(gate_up[3, :gate.shape[0]], gate)
    np.testing.assert_array_equal(down[3], want["model.layers.1.mlp.experts.3.down_proj.weight"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_fp8_pair(tmp_path_factory.mktemp("fp8"))


def greedy(path, **options):
    """16 greedy tokens; the engine closed after (on cuda its pinned host pool is unregistered: a
    registration left behind fails a later pin of the same, reused, address)."""
    llm = LLM(str(path), **{"backend": "cpu", **options})
    try:
        return llm.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    finally:
        llm.core.close()


def test_linears_stay_fp8_row_blocks_holding_the_spec(pair):
    fp8, dense = pair
    cfg = read_model_config(fp8)
    got, want = load_weights(fp8, cfg), load_weights(dense, read_model_config(dense))
    lw, ref = got.layers[0], want.layers[0]
    for name in ("qkv", "o_proj", "gate_up", "down"):
        assert format_of(getattr(lw, name)).name == "fp8_b128", name
        np.testing.assert_array_equal(dequantize_ref(getattr(lw, name)), getattr(ref, name), err_msg=name)
    assert lw.router.dtype == np.float32 and got.embed.dtype == np.float32     # left out of the conversion


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_fp8_computes_what_its_dequantized_twin_computes(pair, backend):
    fp8, dense = pair
    assert greedy(fp8, backend=backend) == greedy(dense, backend=backend)


@pytest.mark.parametrize("moe", [dict(moe_backend="cpu"), dict(moe_backend="offload", moe_cache_rate=0.5),
                                 dict(moe_backend="hybrid", moe_cache_rate=0.5, moe_fetch_fraction=0.3)],
                         ids=lambda o: o["moe_backend"])
def test_every_moe_backend_gives_the_same_tokens(pair, moe):
    assert greedy(pair[0], **moe) == greedy(pair[0], moe_backend="fused")


def test_bf16_scales_and_a_k_that_is_not_a_multiple_of_128(tmp_path):
    fp8, dense = write_fp8_pair(tmp_path, "bfloat16", moe_intermediate=96)     # down_proj K = 96
    w = load_weights(fp8, read_model_config(fp8))
    assert format_of(w.layers[0].qkv).name == "fp8_b128" and w.layers[0].down.dtype == np.float32   # widened
    assert greedy(fp8) == greedy(dense)


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [dict(moe_backend="fused"), dict(moe_backend="cpu"),
                                 dict(moe_backend="offload", moe_cache_rate=0.5),
                                 dict(moe_backend="hybrid", moe_cache_rate=0.5)], ids=lambda o: o["moe_backend"])
def test_the_cuda_backend_gives_the_cpu_tokens(pair, moe):
    assert greedy(pair[0], backend="cuda", **moe) == greedy(pair[0])


# --- the GDN families (Qwen3.5/3.6-MoE, Qwen3-Next) ----------------------------------------------

@pytest.fixture(scope="module", params=["qwen35", "qwen3next"])
def gdn_pair(request, tmp_path_factory):
    return write_fp8_gdn_pair(tmp_path_factory.mktemp(f"fp8_{request.param}"), request.param)


def _logits(path, **options):
    """(weights, logits of PROMPT in one step, logits of its first 4 tokens): 32 tokens take the
    BLAS paths on the CPU, 4 the block GEMVs decode uses. An f32 KV cache for both twins (a
    quantized model's default is bf16)."""
    llm = LLM(str(path), **{"backend": "cpu", "kv_dtype": "float32", **options})
    try:
        return (llm.core.weights, teacher_forced_logits(llm, np.array(PROMPT)),
                teacher_forced_logits(llm, np.array(PROMPT[:4])))
    finally:
        llm.core.close()


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_gdn_fp8_computes_what_its_dequantized_twin_computes(gdn_pair, backend):
    """Attention, GDN in_proj and out_proj, routed and shared experts in FP8 row blocks (the packed
    and the split in_proj re-ordered in blocks; its dense b/a rows a second part), the same
    logits as the dense twin holding the spec's values."""
    (w, got, got4), (_, want, want4) = _logits(gdn_pair[0], backend=backend), _logits(gdn_pair[1], backend=backend)
    gdn, attn = w.layers[0], w.layers[1]
    fp8_part, dense_part = gdn.in_proj
    assert format_of(fp8_part).name == "fp8_b128" and dense_part.dtype == np.float32
    for a in (gdn.out_proj, attn.qkv, attn.o_proj, gdn.gate_up, gdn.down, gdn.shared_gate_up, gdn.shared_down):
        assert format_of(a).name == "fp8_b128"
    for g, ref in ((got, want), (got4, want4)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


@pytest.mark.gpu
def test_gdn_fp8_on_the_cuda_backend(gdn_pair):
    _, want, want4 = _logits(gdn_pair[0])
    _, got, got4 = _logits(gdn_pair[0], backend="cuda", moe_backend="offload", moe_cache_rate=0.5)
    for g, ref in ((got, want), (got4, want4)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


def test_bad_checkpoints_are_one_clear_error(pair, tmp_path):
    fp8, _ = pair
    cfg = json.loads((fp8 / "config.json").read_text())
    for change, message in [({"quant_method": "awq"}, "quant_method 'awq'"),
                            ({"weight_block_size": [64, 64]}, "weight_block_size")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], **change}}))
        with pytest.raises(ConfigError, match=message):
            read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        read_model_config(tmp_path)
    from freetoken.models.safetensors_io import Checkpoint
    ck = Checkpoint(fp8)
    tensors = {n: ck.get(n, ck.shape(n)) for n in ck.names()}
    name = "model.layers.0.self_attn.q_proj.weight"
    tags = {n: ck.stored_dtype(n) for n in tensors}
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (bad / f).write_bytes((fp8 / f).read_bytes())
    save_safetensors(bad / "model.safetensors", {**tensors, name + "_scale_inv": np.ones((2, 2), np.float32)}, tags)
    with pytest.raises(WeightsError, match="q_proj.weight_scale_inv.*wrong shape"):
        load_weights(bad, read_model_config(bad))
    tensors.pop(name + "_scale_inv"), tags.pop(name + "_scale_inv")
    save_safetensors(bad / "model.safetensors", tensors, tags)
    with pytest.raises(WeightsError, match="q_proj.weight' is F8_E4M3 but .*_scale_inv is missing"):
        load_weights(bad, read_model_config(bad))


def test_serve_an_fp8_checkpoint_through_both_sdks():
    """The user's path: `serve --model DIR` on the FP8 fixture, the OpenAI and Anthropic SDKs."""
    assert served_name_after_two_sdk_answers(FIXTURES / "f32_scales") == "f32_scales"
