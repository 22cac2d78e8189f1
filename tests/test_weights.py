"""Safetensors reader/writer round trips and the Qwen3-MoE loader (synthetic checkpoints and the
packaged demo model)."""
import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from freetoken import progress as progress_mod
from freetoken.models.demo import packaged_demo_dir
from freetoken.models.hf_config import model_config_from_dict, read_model_config
from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.models.weights import (Checkpoint, SafetensorsFile, WeightsError, load_weights,
                               save_safetensors)

# H 16, Hq 4, G 2, D 8, E 4 (top-2), I 8, dense width 12, V 32; layer 1 is a dense-MLP layer
CFG_DICT = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "intermediate_size": 12, "mlp_only_layers": [1], "norm_topk_prob": True}
CFG = model_config_from_dict(CFG_DICT)


def synthetic(cfg=CFG, seed=0, packed=False, prefix="model."):
    """HF-named float32 tensors for `cfg` (per-expert, or transformers-5 packed banks)."""
    rng = np.random.default_rng(seed)
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, I, V = cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size
    shapes = {f"{prefix}embed_tokens.weight": (V, H), f"{prefix}norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (Hq * D, H), p + "self_attn.k_proj.weight": (G * D, H),
                       p + "self_attn.v_proj.weight": (G * D, H), p + "self_attn.o_proj.weight": (H, Hq * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if not cfg.is_moe_layer(i):
            Id = cfg.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (Id, H), p + "mlp.up_proj.weight": (Id, H),
                           p + "mlp.down_proj.weight": (H, Id)})
            continue
        shapes[p + "mlp.gate.weight"] = (E, H)
        if packed:
            shapes.update({p + "mlp.experts.gate_up_proj": (E, 2 * I, H),
                           p + "mlp.experts.down_proj": (E, H, I)})
        for e in range(0 if packed else E):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (I, H), q + "up_proj.weight": (I, H),
                           q + "down_proj.weight": (H, I)})
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def as_model_dtype(a, tag):
    """What the loader should hold for float32 `a` written as `tag`."""
    if tag == "BF16":
        return from_f32(a)
    return a.astype(np.float16).astype(np.float32) if tag == "F16" else a


def check_layout(w, t, tag, cfg=CFG, prefix="model."):
    """Every ModelWeights array equals the HF tensors it came from, in the contract layout."""
    I = cfg.moe_intermediate_size
    ref = {n: as_model_dtype(a, tag) for n, a in t.items()}
    np.testing.assert_array_equal(w.embed, ref[f"{prefix}embed_tokens.weight"])
    np.testing.assert_array_equal(w.lm_head, ref["lm_head.weight"])
    np.testing.assert_array_equal(w.final_norm, ref[f"{prefix}norm.weight"])
    for i, lw in enumerate(w.layers):
        p = f"{prefix}layers.{i}."
        qkv = np.concatenate([ref[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        np.testing.assert_array_equal(lw.qkv, qkv)
        np.testing.assert_array_equal(lw.o_proj, ref[p + "self_attn.o_proj.weight"])
        np.testing.assert_array_equal(lw.k_norm, ref[p + "self_attn.k_norm.weight"])
        if not cfg.is_moe_layer(i):
            assert lw.router is None
            Id = cfg.intermediate_size
            assert lw.gate_up.shape == (1, 2 * Id, cfg.hidden_size)
            np.testing.assert_array_equal(lw.gate_up[0, Id:], ref[p + "mlp.up_proj.weight"])
            np.testing.assert_array_equal(lw.down[0], ref[p + "mlp.down_proj.weight"])
            continue
        np.testing.assert_array_equal(lw.router, ref[p + "mlp.gate.weight"])
        for e in range(cfg.num_experts):
            q = f"{p}mlp.experts.{e}."
            if q + "gate_proj.weight" not in ref:  # packed source
                gu, dn = ref[p + "mlp.experts.gate_up_proj"][e], ref[p + "mlp.experts.down_proj"][e]
            else:
                gu = np.concatenate([ref[q + "gate_proj.weight"], ref[q + "up_proj.weight"]])
                dn = ref[q + "down_proj.weight"]
            np.testing.assert_array_equal(lw.gate_up[e], gu)
            np.testing.assert_array_equal(lw.down[e], dn)
        assert lw.gate_up.flags.c_contiguous and lw.down.flags.c_contiguous
        assert lw.gate_up[0, :I].shape == (I, cfg.hidden_size)


# --- safetensors reader/writer ------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["BF16", "F16", "F32"])
def test_safetensors_round_trip(tmp_path, tag):
    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32),
              "b": rng.standard_normal(7).astype(np.float32), "scalar": np.float32(2.5) * np.ones(())}
    arrays = {n: (from_f32(a) if tag == "BF16" else a.astype(np.float16) if tag == "F16" else a)
              for n, a in arrays.items()}
    save_safetensors(tmp_path / "x.safetensors", arrays, tag)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert {n: m["dtype"] for n, m in f.entries.items()} == dict.fromkeys(arrays, tag)
    for n, a in arrays.items():
        got = f.get(n)
        assert got.shape == a.shape
        assert got.dtype == {"BF16": np.uint16, "F16": np.float32, "F32": np.float32}[tag]
        np.testing.assert_array_equal(got, a.astype(np.float32) if tag == "F16" else a)


def test_save_bf16_rounds_float_input(tmp_path):
    x = np.array([1.0, 1.00390625, -3.3e-3, np.inf], np.float32)
    save_safetensors(tmp_path / "x.safetensors", {"x": x}, {"x": "BF16"})
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "x.safetensors").get("x"), from_f32(x))


def test_interoperates_with_safetensors_package(tmp_path):
    import safetensors.numpy as st
    arrays = {"h": np.arange(6, dtype=np.float16).reshape(2, 3), "f": np.linspace(0, 1, 5, dtype=np.float32)}
    save_safetensors(tmp_path / "ours.safetensors", arrays)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    for n, a in arrays.items():
        np.testing.assert_array_equal(theirs[n], a)
    st.save_file(arrays, str(tmp_path / "theirs.safetensors"))
    f = SafetensorsFile(tmp_path / "theirs.safetensors")
    np.testing.assert_array_equal(f.get("h"), arrays["h"].astype(np.float32))
    np.testing.assert_array_equal(f.get("f"), arrays["f"])


def test_unsupported_dtype_is_a_clear_error(tmp_path):
    header = json.dumps({"q": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(WeightsError, match=r"'q' has dtype I8; supported: BF16, F16, F32"):
        SafetensorsFile(tmp_path / "x.safetensors").get("q")


def test_truncated_file_is_a_clear_error(tmp_path):
    save_safetensors(tmp_path / "x.safetensors", {"x": np.ones(64, np.float32)})
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:-16])
    with pytest.raises(WeightsError, match="data_offsets"):
        SafetensorsFile(tmp_path / "x.safetensors").get("x")


# --- loader --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tag,dtype", [("BF16", np.uint16), ("F16", np.float32), ("F32", np.float32)])
def test_load_weights_layout(tmp_path, tag, dtype):
    t = synthetic()
    save_safetensors(tmp_path / "model.safetensors", t, tag)
    w = load_weights(tmp_path, CFG)
    assert {a.dtype for a in (w.embed, w.lm_head, w.layers[0].gate_up, w.layers[1].down)} == {np.dtype(dtype)}
    check_layout(w, t, tag)


def test_sharded_checkpoint(tmp_path):
    t = synthetic()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_safetensors(tmp_path / file, {n: t[n] for n in part}, "BF16")
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_layout(load_weights(tmp_path, CFG), t, "BF16")


def test_packed_experts_and_language_model_prefix(tmp_path):
    t = synthetic(packed=True, prefix="model.language_model.")
    save_safetensors(tmp_path / "model.safetensors", t, "BF16")
    w = load_weights(tmp_path, CFG)
    check_layout(w, t, "BF16", prefix="model.language_model.")
    gate_up = w.layers[0].gate_up      # same layout as ours: read straight into an array it owns
    assert gate_up.base is None and gate_up.flags.writeable and not isinstance(gate_up, np.memmap)


def test_tied_embeddings_share_the_array(tmp_path):
    cfg = model_config_from_dict({**CFG_DICT, "tie_word_embeddings": True})
    t = synthetic(cfg)
    del t["lm_head.weight"]
    save_safetensors(tmp_path / "model.safetensors", t, "F32")
    w = load_weights(tmp_path, cfg)
    assert w.lm_head is w.embed


def test_mixed_dtypes_follow_the_bf16_majority(tmp_path):
    t = synthetic()
    tags = {n: "F32" if n.endswith("norm.weight") else "BF16" for n in t}
    save_safetensors(tmp_path / "model.safetensors", t, tags)
    w = load_weights(tmp_path, CFG)
    assert w.final_norm.dtype == np.uint16
    np.testing.assert_array_equal(w.final_norm, from_f32(t["model.norm.weight"]))


def test_missing_tensor_names_it(tmp_path):
    t = synthetic()
    del t["model.layers.1.self_attn.v_proj.weight"]
    save_safetensors(tmp_path / "model.safetensors", t, "BF16")
    with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj\.weight' "
                                           r"\(expected shape \(16, 16\), found none\)"):
        load_weights(tmp_path, CFG)


def test_misshaped_tensor_names_both_shapes(tmp_path):
    t = synthetic()
    t["model.layers.0.mlp.experts.3.down_proj.weight"] = np.zeros((8, 16), np.float32)  # transposed
    save_safetensors(tmp_path / "model.safetensors", t, "BF16")
    with pytest.raises(WeightsError, match=r"'model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight' has the "
                                           r"wrong shape: expected \(16, 8\), found \(8, 16\)"):
        load_weights(tmp_path, CFG)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load_weights(tmp_path, CFG)



# --- the packaged demo checkpoint (tiny-agent-moe: a trained Qwen3-MoE, bf16, per-expert names) --

def test_packaged_demo_banks():
    demo = packaged_demo_dir()
    cfg = read_model_config(demo)
    w = load_weights(demo, cfg)
    H, E, I, D = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim
    assert w.embed.shape == w.lm_head.shape == (cfg.vocab_size, H) and w.lm_head is not w.embed
    assert len(w.layers) == cfg.num_layers == 4
    for lw in w.layers:
        assert lw.qkv.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H)
        assert lw.router.shape == (E, H)
        assert lw.gate_up.shape == (E, 2 * I, H) and lw.down.shape == (E, H, I)
        assert lw.gate_up.dtype == lw.down.dtype == np.uint16
    raw = Checkpoint(demo)
    up = raw.get("model.layers.2.mlp.experts.5.up_proj.weight", (I, H))
    np.testing.assert_array_equal(w.layers[2].gate_up[5, I:], up)
    assert np.isfinite(to_f32(w.layers[3].down)).all()


# --- progress bar (used while stacking) ----------------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_silent_off_a_terminal(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    assert list(progress_mod.progress(range(3), 3, "x")) == [0, 1, 2]
    assert stream.getvalue() == ""


def test_progress_draws_on_a_terminal(monkeypatch):
    stream = _Tty()
    monkeypatch.setattr("sys.stderr", stream)
    assert list(progress_mod.progress(iter("ab"), 2, "loading")) == ["a", "b"]
    assert "loading [" in stream.getvalue() and "2/2" in stream.getvalue()
    assert stream.getvalue().endswith("\n")


def _weights_arrays(w):
    yield from (w.embed, w.final_norm, w.lm_head)
    for lw in w.layers:
        yield from (a for a in vars(lw).values() if isinstance(a, np.ndarray))


@pytest.mark.parametrize("tag", ["BF16", "F32"])
def test_loaded_weights_hold_no_mapping_of_the_file(tmp_path, tag):
    """Every array is the process's own memory, and the file is not mapped once loading is done:
    a mapping would keep the checkpoint's pages in RSS beside the copies (2x the model)."""
    save_safetensors(tmp_path / "model.safetensors", synthetic(), tag)
    w = load_weights(tmp_path, CFG)
    for a in _weights_arrays(w):
        assert not isinstance(a, np.memmap) and a.flags.writeable
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(tmp_path / "model.safetensors") not in maps.read_text()


def test_a_truncated_file_is_a_clear_error(tmp_path):
    save_safetensors(tmp_path / "x.safetensors", {"x": np.ones((64, 64), np.float32)}, "F32")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    with open(tmp_path / "x.safetensors", "r+b") as fh:
        fh.truncate(fh.seek(0, 2) - 100)
    with pytest.raises(WeightsError, match="ended 100 bytes early"):
        f.get("x")


@pytest.mark.parametrize("scatter", [True, False])
def test_read_many_fills_each_array_from_adjacent_runs(tmp_path, monkeypatch, scatter):
    """Tensors adjacent in the file go in one scattered read (or, without os.preadv, one read
    each), in any order asked, into slices of one bank; one stored as F32 for a bf16 bank comes
    back as left over, for the caller to convert."""
    from freetoken.models import safetensors_io
    monkeypatch.setattr(safetensors_io, "_SCATTER", scatter)
    rng = np.random.default_rng(3)
    tensors = {f"e.{i}.w": rng.integers(0, 1 << 16, (4 + i, 6)).astype(np.uint16) for i in range(5)}
    tensors["e.9.f32"] = rng.standard_normal((2, 6)).astype(np.float32)
    save_safetensors(tmp_path / "model.safetensors", tensors)
    ck = Checkpoint(tmp_path)
    bank = np.zeros((sum(4 + i for i in range(5)) + 2, 6), np.uint16)
    rows, at, items = {}, 0, []
    for i in (3, 0, 4, 1, 2):
        rows[i] = slice(at, at + 4 + i)
        items.append((f"e.{i}.w", (4 + i, 6), bank[rows[i]]))
        at += 4 + i
    items.append(("e.9.f32", (2, 6), bank[at:]))
    left = ck.read_many(items)
    assert [name for name, _, _ in left] == ["e.9.f32"]
    for i, r in rows.items():
        np.testing.assert_array_equal(bank[r], tensors[f"e.{i}.w"])
    assert not bank[at:].any()
    with pytest.raises(WeightsError, match="wrong shape"):
        ck.read_many([("e.0.w", (5, 6), bank[:5])])
