"""The built-in models shipped inside the package: `tiny-agent-moe` (a small trained Qwen3-MoE
that calls tools; the default, also `--model demo`), `tiny-agent-hybrid` (its Gated DeltaNet
hybrid sibling in the Qwen3.5-MoE layout, `--model demo-hybrid`), `tiny-agent-oss` (a gpt-oss
that speaks harmony, MXFP4 experts, `--model demo-oss`), and the tokenizer synthetic
and random test models use (`synth-tokenizer`: the same vocabulary with the plain Qwen3-style
template)."""
from __future__ import annotations

import re
from pathlib import Path

DEMO_NAME = "tiny-agent-moe"
BUILTIN = {"demo": DEMO_NAME, "demo-hybrid": "tiny-agent-hybrid", "demo-oss": "tiny-agent-oss"}   # short --model names
DATA = Path(__file__).resolve().parents[1] / "data"      # freetoken/data


def packaged_demo_dir() -> Path:
    """Directory of the packaged demo model (config.json, model.safetensors, tokenizer files)."""
    return DATA / DEMO_NAME


def synth_tokenizer_dir() -> Path:
    """Tokenizer files (no weights) of synth:NAME and random test models: the demo vocabulary with
    the Qwen3-style template that renders every message and tool schema whole."""
    return DATA / "synth-tokenizer"


def resolve_model_dir(model: str | None, log) -> Path:
    """The model directory to load: the given one, a built-in model by its short name, or the
    packaged demo model (logged)."""
    if model is None or model in BUILTIN:
        path = DATA / BUILTIN.get(model, DEMO_NAME)
        log.info("%s: using the built-in demo model %s (%s)", "no --model given" if model is None else f"--model {model}",
                 path.name, path)
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(not_a_model_dir(model, path))
    return path


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
MODEL_FORMS = ("a model is a Hugging Face model directory (config.json, tokenizer.json, *.safetensors), "
               "a .gguf file, or synth:NAME")


def not_a_model_dir(model: str, path: Path) -> str:
    """Why --model ``model`` (not a directory) cannot be loaded, and what to pass instead."""
    if path.is_file():
        part = {".safetensors": "a safetensors weights file", ".json": "a JSON file",
                ".bin": "a PyTorch weights file (not read: convert it to safetensors)"}.get(path.suffix)
        if part:
            return f"--model {model}: {path} is {part}, part of a model: pass its directory ({MODEL_FORMS})"
        return f"--model {model}: {path} is a file FreeToken cannot load ({MODEL_FORMS})"
    if HUB_ID.fullmatch(model) and not model.startswith((".", "~")):
        local = f"~/models/{model.split('/')[-1]}"
        return (f"--model {model}: no such directory here, and it looks like a Hugging Face Hub id: "
                f"FreeToken does not download models. Fetch it first (pip install huggingface_hub; "
                f"hf download {model} --local-dir {local}) and pass --model {local}, or a .gguf file")
    return f"--model {model}: model directory {path} does not exist ({MODEL_FORMS})"


RANDOM_SHAPE = dict(hidden=128, layers=4, experts=16, top_k=4, moe_intermediate=64, heads=4,
                    kv_heads=2, head_dim=32, vocab=4096)


def random_config(*, hidden, layers, experts, top_k, moe_intermediate, heads, kv_heads, head_dim,
                  vocab, norm_topk_prob=True, dtype="bfloat16", max_positions=2048) -> dict:
    """A Hugging Face config.json for a Qwen3-MoE of the given shape."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate,
        "intermediate_size": 2 * moe_intermediate, "norm_topk_prob": norm_topk_prob,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": max_positions,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": dtype,
        "eos_token_id": 2, "bos_token_id": None, "pad_token_id": 0,
    }


def random_tensors(cfg: dict, seed: int = 0, std: float = 0.02) -> dict:
    """Deterministic random float32 weights with Hugging Face Qwen3-MoE names."""
    import numpy as np
    rng = np.random.default_rng(seed)
    H, D, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    Hq, G, E, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["moe_intermediate_size"]
    normal = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * std)
    ones = lambda n: (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32))
    t = {"model.embed_tokens.weight": normal(V, H), "model.norm.weight": ones(H), "lm_head.weight": normal(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
                  p + "self_attn.q_proj.weight": normal(Hq * D, H), p + "self_attn.k_proj.weight": normal(G * D, H),
                  p + "self_attn.v_proj.weight": normal(G * D, H), p + "self_attn.o_proj.weight": normal(H, Hq * D),
                  p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D),
                  p + "mlp.gate.weight": normal(E, H)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t.update({q + "gate_proj.weight": normal(I, H), q + "up_proj.weight": normal(I, H),
                      q + "down_proj.weight": normal(H, I)})
    return t


def write_random_model(out_dir, seed: int = 0, **shape) -> Path:
    """Write a deterministic tiny random Qwen3-MoE (HF format, bf16) with the demo tokenizer."""
    import json
    import shutil
    from freetoken.models.weights import save_safetensors
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = random_config(**{**RANDOM_SHAPE, **shape})
    save_safetensors(out / "model.safetensors", random_tensors(cfg, seed), "BF16")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(synth_tokenizer_dir() / name, out / name)   # not the (read-only) mode
    return out


def write_demo_model(out_dir, name: str = "demo") -> Path:
    """Copy a packaged model (a BUILTIN short name) to out_dir (a plain Hugging Face directory)."""
    import shutil
    out = Path(out_dir)
    shutil.copytree(DATA / BUILTIN[name], out, dirs_exist_ok=True, copy_function=shutil.copyfile)
    return out
