"""GGUF files of the Gated DeltaNet hybrids as llama.cpp's converter writes them (tests/fixtures/gguf/
qwen35moe-*, qwen3next-*; made by tests/fixtures/make_gguf_gdn_fixtures.py): models/gguf_gdn.py
undoes the converter's renames, splits, row re-orders, 1 + w norms and -exp(A_log).

F32 files hold the HF weights: qwen35moe-f32 is the qwen35moe_text HF fixture (its expected.npz),
qwen3next-f32 a variant of the qwen3next one that llama.cpp can represent (no dense-MLP layer,
norm_topk_prob true, expert width 32). Q8_0 files against transformers on the file's tensors
dequantized by gguf-py. Tolerances as tests/models/test_hf_hybrid_parity.py: logits to 2e-4, the
32 greedy tokens exact, on ref and cpu; the emulated device's greedy tokens too.
"""
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_gguf import matches_transformers

from freetoken import LLM, SamplingParams
from freetoken.kernels.qformats import dequantize_ref, is_quantized
from freetoken.models.gguf_file import GGUFError, open_gguf
from freetoken.models.gguf_gdn import _orders, gdn_gguf_config, gdn_gguf_weights
from freetoken.models.hf_config import read_model_config
from freetoken.models.weights import load_weights

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GGUF, HF = FIXTURES / "gguf", FIXTURES / "hf"
FILES = {"qwen35moe-f32": HF / "qwen35moe_text" / "fp32" / "expected.npz",
         "qwen35moe-q8_0": GGUF / "qwen35moe-q8_0.expected.npz",
         "qwen3next-f32": GGUF / "qwen3next-f32.expected.npz",
         "qwen3next-q8_0": GGUF / "qwen3next-q8_0.expected.npz"}
# what make_gguf_gdn_fixtures.py changed in the qwen3next HF fixture's config for its variant
QWEN3NEXT_VARIANT = dict(mlp_only_layers=(), norm_topk_prob=True, moe_intermediate_size=32)


def hf_config_of(name: str):
    if name.startswith("qwen35moe"):
        return read_model_config(HF / "qwen35moe_text" / "fp32")
    return dataclasses.replace(read_model_config(HF / "qwen3next" / "fp32"), **QWEN3NEXT_VARIANT)


def check(name: str, backend: str, **options) -> None:
    matches_transformers(GGUF / f"{name}.gguf", np.load(FILES[name]), backend, **options)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("name", FILES)
def test_logits_and_greedy_tokens_are_transformers(name, backend):
    check(name, backend)


def test_a_fused_file_is_the_same_model():
    """--fuse-qkv (the attention layers' attn_qkv) and --fuse-gate-up-exps (ffn_gate_up_exps
    [E, 2I, H], FreeToken's bank layout) hold the same blocks as the unfused Q8_0 file."""
    matches_transformers(GGUF / "qwen35moe-q8_0-fused.gguf", np.load(FILES["qwen35moe-q8_0"]), "cpu")


def test_every_moe_backend_on_a_gguf_hybrid():
    check("qwen3next-q8_0", "cpu", chunked_prefill_size=7, moe_backend="hybrid", moe_cache_rate=0.5,
          moe_fetch_fraction=0.3)


@pytest.mark.parametrize("name", FILES)
def test_the_config_is_the_checkpoints(name):
    assert gdn_gguf_config(open_gguf(GGUF / f"{name}.gguf")) == hf_config_of(name)


def test_the_f32_file_holds_the_hf_checkpoints_arrays():
    """Every array the HF loader builds, the GGUF loader builds from the F32 file, bit for bit
    (in_proj rows and the value heads re-ordered back; A_log back through -exp and log)."""
    model = open_gguf(GGUF / "qwen35moe-f32.gguf")
    cfg = gdn_gguf_config(model)
    ours, theirs = gdn_gguf_weights(model, cfg), load_weights(HF / "qwen35moe_text" / "fp32", cfg)
    for a, b in zip(ours.layers, theirs.layers):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (x is None) == (y is None), f.name
            if x is not None:
                assert x.dtype == y.dtype and np.array_equal(x, y), f.name
    assert np.array_equal(ours.embed, theirs.embed) and np.array_equal(ours.final_norm, theirs.final_norm)


def _values(w):
    return np.concatenate([_values(p) for p in w]) if isinstance(w, tuple) else \
        dequantize_ref(w) if is_quantized(w) else w


@pytest.mark.parametrize("name,out_proj_blocks,experts_blocks",
                         [("qwen35moe-q8_0", False, False), ("qwen3next-q8_0", True, True)])
def test_what_stays_in_blocks(name, out_proj_blocks, experts_blocks):
    """in_proj (rows gathered on the blocks), the shared expert and the attention linears stay in
    Q8_0; qwen35moe's ssm_out is widened (its value heads of Dv 24 values are not whole blocks of
    32) and its experts too (the converter left down in F16); qwen3next keeps both. The values are
    gguf-py's dequantization of the file's, re-ordered as the F32 file's are."""
    model = open_gguf(GGUF / f"{name}.gguf")
    cfg = gdn_gguf_config(model)
    w = gdn_gguf_weights(model, cfg)
    f32 = gdn_gguf_weights(open_gguf(GGUF / f"{name.split('-')[0]}-f32.gguf"), cfg)
    gdn, att = w.layers[cfg.linear_layers[0]], w.layers[cfg.attention_layers[0]]
    assert is_quantized(gdn.in_proj) and is_quantized(gdn.shared_gate_up) and is_quantized(att.qkv)
    assert is_quantized(gdn.out_proj) == out_proj_blocks and is_quantized(gdn.gate_up) == experts_blocks
    assert gdn.A_log.dtype == np.float32 and not is_quantized(gdn.conv)
    ref = f32.layers[cfg.linear_layers[0]]
    for a, b in ((gdn.in_proj, ref.in_proj), (gdn.out_proj, ref.out_proj)):
        np.testing.assert_allclose(_values(a), b, atol=0.01, rtol=0)      # Q8_0's error, not a row moved


def test_value_head_orders_invert_the_converters_tiling():
    """Qwen3.5's converter tiles the value heads (_reorder_v_heads: grouped head g*r + j goes to
    j*Hk + g); the orders put each row back, and a head of Dv values that are whole Q8_0 blocks
    moves as blocks (ssm_out's columns, Dv 128 in the released models; 64 here)."""
    from gguf import GGMLQuantizationType, quants
    Hk, Hv, Dv, H = 2, 6, 64, 8
    cfg = dataclasses.replace(hf_config_of("qwen35moe"), linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                              linear_value_head_dim=Dv)
    orders = _orders(cfg, "qwen35moe")
    grouped = np.random.default_rng(0).standard_normal((H, Hv * Dv)).astype(np.float32)
    tiled = grouped.reshape(H, Hk, Hv // Hk, Dv).swapaxes(1, 2).reshape(H, -1)     # the converter, columns
    assert np.array_equal(tiled[:, orders["v"]], grouped)
    blocks = quants.quantize(tiled, GGMLQuantizationType.Q8_0).reshape(H, -1, 34)
    per = Dv // 32
    moved = blocks[:, (orders["heads"][:, None] * per + np.arange(per)).ravel()]
    np.testing.assert_array_equal(dequantize_ref(moved), dequantize_ref(blocks)[:, orders["v"]])


@pytest.mark.parametrize("change, message", [
    (lambda m: {k: v for k, v in m.tensors.items() if k != "blk.0.ssm_ba.weight"},
     r"tensor blk\.0\.ssm_ba\.weight is missing"),
    (lambda m: {**m.tensors, "blk.2.ssm_a": m.tensors["blk.0.ssm_norm.weight"]},
     r"tensor blk\.2\.ssm_a holds \(16,\) values, the config implies \(4,\)"),
], ids=["missing", "shape"])
def test_a_missing_or_misshapen_tensor_is_named_before_anything_is_widened(change, message, monkeypatch):
    from gguf import quants
    model = open_gguf(GGUF / "qwen3next-q8_0.gguf")
    cfg = gdn_gguf_config(model)
    monkeypatch.setattr(quants, "dequantize", lambda *a: pytest.fail("widened first"))
    with pytest.raises(GGUFError, match=message):
        gdn_gguf_weights(dataclasses.replace(model, tensors=change(model)), cfg)


def test_a_legacy_qwen3next_file_with_ssm_in_reads_the_same_weights():
    """The converter's first Qwen3-Next files keep in_proj_qkvz whole (ssm_in, rows per key head
    [q | k | v | z]); llama.cpp still loads them: the same in_proj as the split file's. (F32: a
    made-up tensor's values are read from memory; blocks are read from the file by offset, and the
    row gather is the same for both.)"""
    model = open_gguf(GGUF / "qwen3next-f32.gguf")
    cfg = gdn_gguf_config(model)
    Hk, Dk, Hv, Dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, \
        cfg.linear_value_head_dim
    r = Hv // Hk
    tensors = dict(model.tensors)
    for i in (i for i in range(cfg.num_layers) if cfg.is_linear_layer(i)):
        qkv, gate = tensors.pop(f"blk.{i}.attn_qkv.weight"), tensors.pop(f"blk.{i}.attn_gate.weight")
        assert qkv.type_name == gate.type_name == "F32"
        q, k, v = np.split(np.asarray(qkv.data), [Hk * Dk, 2 * Hk * Dk])            # [all q | all k | all v]
        z = np.asarray(gate.data)
        grouped = np.concatenate([np.concatenate([q[g * Dk:(g + 1) * Dk], k[g * Dk:(g + 1) * Dk],
                                                  v[g * r * Dv:(g + 1) * r * Dv], z[g * r * Dv:(g + 1) * r * Dv]])
                                  for g in range(Hk)])                              # per key head q|k|v|z
        name = f"blk.{i}.ssm_in.weight"
        tensors[name] = dataclasses.replace(qkv, name=name, shape=(grouped.shape[0], qkv.shape[1]), data=grouped)
    legacy = dataclasses.replace(model, tensors=tensors)
    got, want = gdn_gguf_weights(legacy, cfg), gdn_gguf_weights(model, cfg)
    for lg, lw in zip(got.layers, want.layers):
        if lw.in_proj is not None:
            assert np.array_equal(lg.in_proj, lw.in_proj)


def test_multi_token_prediction_blocks_are_left_out():
    """The converter (without --no-mtp) appends the MTP blocks: block_count counts them,
    nextn_predict_layers says how many, recurrent_layers lists them as not recurrent."""
    model = open_gguf(GGUF / "qwen35moe-f32.gguf")
    meta = {**model.metadata, "qwen35moe.block_count": 5, "qwen35moe.nextn_predict_layers": 1,
            "qwen35moe.attention.recurrent_layers": [True, False, True, True, False]}
    mtp = {"blk.4.nextn.eh_proj.weight": model.tensors["blk.1.attn_k.weight"]}    # any tensor: never read
    with_mtp = dataclasses.replace(model, metadata=meta, tensors={**model.tensors, **mtp})
    cfg = gdn_gguf_config(with_mtp)
    assert cfg == hf_config_of("qwen35moe")
    assert len(gdn_gguf_weights(with_mtp, cfg).layers) == 4


def test_a_value_head_count_that_does_not_divide_the_inner_size_is_named():
    model = open_gguf(GGUF / "qwen35moe-f32.gguf")
    broken = dataclasses.replace(model, metadata={**model.metadata, "qwen35moe.ssm.time_step_rank": 5})
    with pytest.raises(GGUFError, match="ssm.inner_size 96 is not a multiple of ssm.time_step_rank 5"):
        gdn_gguf_config(broken)


@pytest.mark.gpu
@pytest.mark.parametrize("name,moe", [("qwen3next-q8_0", "fused"), ("qwen3next-q8_0", "hybrid"),
                                      ("qwen35moe-q8_0", "fused")])
def test_the_cuda_backend_gives_transformers_tokens(name, moe):
    """The cuda backend (emulated in CI): in_proj, the attention linears, the shared expert and the
    embedding in their Q8_0 blocks on the device; the greedy tokens as on the CPU."""
    exp = np.load(FILES[name])
    options = dict(moe_backend="hybrid", moe_cache_rate=0.5, moe_fetch_fraction=0.3) if moe == "hybrid" else \
        dict(moe_backend=moe)
    llm = LLM(str(GGUF / f"{name}.gguf"), backend="cuda", cpu_dots="f32", **options)   # CPU experts in fp32
    try:
        layer = llm.core.weights.layers[0]                              # a GDN layer in both files
        assert is_quantized(layer.in_proj) and is_quantized(layer.shared_gate_up)
        assert is_quantized(llm.core.weights.embed)
        out = llm.generate([exp["prompt_ids"].tolist()], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        assert out.token_ids == exp["greedy_ids"][:16].tolist()
    finally:
        llm.core.close()
