"""The built-in gpt-oss model's pieces for tools/train_demo.py --arch oss (dev time only).

tiny-agent-oss is a GptOssForCausalLM in tiny-agent-moe's shape (4 layers, hidden 256, 16 experts
top-4, 8 query heads over 2 KV heads) with gpt-oss's own parts: sliding layers (window 128) between
full ones, a learned sink per head, biased projections and router, the clamped SwiGLU. It speaks
harmony: the demo vocabulary plus harmony's seven markers as special tokens, rendered by the
compact tools/harmony_template.jinja. Two cores cannot teach a model harness traffic from nothing
in an hour, so it starts from tiny-agent-moe (`transplant`):
  - embedding, output head, norms, router weights and attention projections are copied (the
    markers' rows from their ChatML counterparts); biases start at zero, sinks low;
  - experts are copied: gpt-oss computes (up + 1) * g * sigmoid(1.702 g) on clamped values, so
    gate rows are divided by 1.702, up rows multiplied by it, and up's bias is -1, which gives
    silu(gate) * up while the clamps do not bite. They do bite: up' = 1.702 up - 1 clamped to
    [-7, 7] keeps up in [-3.5, 4.7], and on tiny-agent-moe's hidden states 8-78% of a layer's
    tokens moved by more than 1% (a helper's check, 2026-12-07; moving the factor into down_proj,
    gate / 1.702, up / 2 - 1, down x 3.404, keeps layers 1-3 exact). The built-in model was trained
    from this copy, which is a start to learn from, not an identity;
  - what has no counterpart (Qwen3's per-head q/k norms) is lost and relearned.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tools" / "harmony_template.jinja"
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# each marker's embedding and head rows start from this ChatML token's (or text's first token's)
LIKE = {"<|start|>": "<|im_start|>", "<|end|>": "<|im_end|>", "<|return|>": "<|im_end|>",
        "<|call|>": "<|im_end|>", "<|message|>": "\n", "<|channel|>": " ", "<|constrain|>": " "}
ALPHA = 1.702


def write_tokenizer(out: Path) -> Path:
    """The demo vocabulary with the markers added as special tokens, the harmony template, and
    <|return|> / <|call|> as the stop tokens (as gpt-oss's generation_config.json)."""
    from tokenizers import Tokenizer as HF

    from freetoken.models.demo import synth_tokenizer_dir
    out.mkdir(parents=True, exist_ok=True)
    tok = HF.from_file(str(synth_tokenizer_dir() / "tokenizer.json"))
    tok.add_special_tokens(MARKERS)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((synth_tokenizer_dir() / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    for marker in MARKERS:
        decoder[str(tok.token_to_id(marker))] = {**decoder["1"], "content": marker}
    config.update(eos_token="<|return|>", chat_template=TEMPLATE.read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    stops = [tok.token_to_id(m) for m in ("<|return|>", "<|call|>")]
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": stops,
                                                            "pad_token_id": 0}, indent=2) + "\n")
    return out


def config(vocab: int, stops: list[int]):
    from transformers import GptOssConfig
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=32, num_local_experts=16, num_experts_per_tok=4,
                       intermediate_size=128, sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
                       max_position_embeddings=2048, tie_word_embeddings=False, router_aux_loss_coef=0.01,
                       eos_token_id=stops, pad_token_id=0, bos_token_id=None, attention_bias=True)
    cfg.output_router_logits = True
    cfg._attn_implementation = "eager"         # the sinks
    return cfg


def build(init: str, tok, torch):
    """--init a GptOss directory (continue it) or a Qwen3-MoE one (transplant it)."""
    from transformers import AutoConfig, GptOssConfig, GptOssForCausalLM, Qwen3MoeForCausalLM
    if AutoConfig.from_pretrained(init).architectures[0] == "GptOssForCausalLM":
        cfg = GptOssConfig.from_pretrained(init)
        cfg.output_router_logits = True
        return GptOssForCausalLM.from_pretrained(init, config=cfg, dtype=torch.float32,
                                                 attn_implementation="eager"), cfg
    stops = [tok.token_to_id(m) for m in ("<|return|>", "<|call|>")]
    cfg = config(AutoConfig.from_pretrained(init).vocab_size, stops)      # the donor's padded vocabulary
    model = GptOssForCausalLM(cfg)
    copied = transplant(model, Qwen3MoeForCausalLM.from_pretrained(init, dtype=torch.float32), tok, torch)
    print(f"oss: {len(copied)} tensors copied from {init} (tools/oss_demo.py)", flush=True)
    return model, cfg


def transplant(model, donor, tok, torch) -> list[str]:
    src, dst, copied = dict(donor.named_parameters()), dict(model.named_parameters()), []

    def put(name: str, value) -> None:
        with torch.no_grad():
            dst[name].copy_(value)
        copied.append(name)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = src[name].clone()                  # the markers' ids lie in the donor's padding rows
        for m in MARKERS:
            rows[tok.token_to_id(m)] = src[name][tok.token_to_id(LIKE[m]) if LIKE[m].startswith("<|")
                                                  else tok.encode(LIKE[m])[0]]
        put(name, rows)
    put("model.norm.weight", src["model.norm.weight"])
    for i in range(model.config.num_hidden_layers):
        _layer(put, src, dst, f"model.layers.{i}.", torch)
    return copied


def _layer(put, src, dst, pre: str, torch) -> None:
    for w in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"):
        put(pre + w, src[pre + w])
    for b in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"):
        put(pre + "self_attn." + b, torch.zeros_like(dst[pre + "self_attn." + b]))
    put(pre + "self_attn.sinks", torch.full_like(dst[pre + "self_attn.sinks"], -4.0))
    put(pre + "mlp.router.weight", src[pre + "mlp.gate.weight"])
    put(pre + "mlp.router.bias", torch.zeros_like(dst[pre + "mlp.router.bias"]))
    gate, up = src[pre + "mlp.experts.gate_up_proj"].chunk(2, dim=1)         # [E, I, H] each
    gate_up = torch.stack([gate / ALPHA, up * ALPHA], dim=-1)                   # [E, I, H, 2]
    put(pre + "mlp.experts.gate_up_proj", gate_up.permute(0, 2, 1, 3).reshape(gate.shape[0], gate.shape[2], -1))
    bias = torch.zeros_like(dst[pre + "mlp.experts.gate_up_proj_bias"])
    bias[:, 1::2] = -1.0
    put(pre + "mlp.experts.gate_up_proj_bias", bias)
    put(pre + "mlp.experts.down_proj", src[pre + "mlp.experts.down_proj"].transpose(1, 2))
    put(pre + "mlp.experts.down_proj_bias", torch.zeros_like(dst[pre + "mlp.experts.down_proj_bias"]))


def harmony_messages(messages: list[dict]) -> list[dict]:
    """The corpus's messages with each call's arguments as compact JSON text, the form the
    tool-call grammar holds the model to."""
    out = []
    for m in messages:
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"],
                                                                             separators=(",", ":"))}}
                 for c in m.get("tool_calls") or []]
        out.append({**m, "tool_calls": calls} if calls else m)
    return out


ASSISTANT = re.compile(r"<\|start\|>assistant(.*?)(<\|end\|>|<\|call\|>|<\|return\|>)", re.S)


def masked(tok, text: str, copy_weight: float, between_backticks) -> tuple[list[int], list[float]]:
    """(ids, loss weights) of a rendered harmony conversation: 1 on what the model writes, each
    assistant message after its header through its end marker, and the header of a message that
    follows another of the same turn; the last final message ends with <|return|> (a final's
    <|end|> in history is not written by the model: weight 0); copy_weight between backticks."""
    if text.endswith("<|end|>") and text.rfind("<|channel|>final") > text.rfind("<|start|>"):
        text = text[:-len("<|end|>")] + "<|return|>"
    flags, last_end = [0.0] * (len(text) + 1), -1
    for m in ASSISTANT.finditer(text):
        begin = m.start() if m.start() == last_end else m.start(1)
        flags[begin:m.end()] = [1.0] * (m.end() - begin)
        quoted = between_backticks(m.group(1))
        for k, q in enumerate(quoted[:len(m.group(1))]):
            if q:
                flags[m.start(1) + k] = copy_weight
        if m.group(2) == "<|end|>" and "<|channel|>final" in m.group(1):
            flags[m.start(2):m.end()] = [0.0] * (m.end() - m.start(2))
        last_end = m.end()
    encoding = tok._tok.encode(text, add_special_tokens=False)
    return encoding.ids, [flags[a] for a, _ in encoding.offsets]


def quantize_experts(model_dir: Path) -> None:
    """Rewrite a saved model's experts in the hub's MXFP4 layout (`_blocks` + `_scales`, rows the
    out features, the fixtures' quantizer), the rest as saved (bf16), and say so in config.json."""
    import torch
    from safetensors.torch import load_file, save_file
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from make_gpt_oss_fixtures import mxfp4
    path = model_dir / "model.safetensors"
    tensors = {}
    for name, t in load_file(path).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4(t.to(torch.float32).transpose(1, 2))
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_card(model_dir: Path, ev: dict) -> None:
    """README.md of tiny-agent-oss from train_log.json and tools/eval_demo.py's numbers."""
    from model_card import _calls_table, _pct
    log, cfg = (json.loads((model_dir / f).read_text()) for f in ("train_log.json", "config.json"))
    a, losses = log["args"], [r["loss"] for r in log["log"]]
    experts = "MXFP4 blocks (the hub's layout)" if cfg.get("quantization_config") else "bf16"
    lines = [f"# {model_dir.name}", "",
             "A tiny gpt-oss (`GptOssForCausalLM`) that speaks harmony and acts like an agent's model: given a",
             "harness's tools and a request that needs one, it writes a message to `functions.NAME` on the",
             "commentary channel, reads the tool's message, and answers on the final channel. Trained by",
             "`tools/train_demo.py --arch oss` (FreeToken's repository) on the synthetic agent conversations of the",
             "other built-in models rendered in harmony. Far too small to be useful as an assistant; it exists so",
             "that Codex CLI and the other harnesses can be shown doing real round trips against a gpt-oss model",
             "with no network and no GPU.", "", "## Architecture", "",
             f"{cfg['num_hidden_layers']} layers ({', '.join(t.split('_')[0] for t in cfg['layer_types'])}; window "
             f"{cfg['sliding_window']}), hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} query / "
             f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']} with biases and a learned sink each, "
             f"{cfg['num_local_experts']} experts top-{cfg['num_experts_per_tok']} (width {cfg['intermediate_size']}, "
             f"biased, the clamped SwiGLU) in every layer, stored as {experts}; the rest bf16. Vocabulary: the other "
             "built-in models' plus harmony's seven markers as special tokens; `<|return|>` and `<|call|>` end a reply.",
             "", "## Chat template", "",
             "`tools/harmony_template.jinja`: harmony's messages with the other built-in models' compaction (the",
             "harness's system prompt as its first paragraph and working directory, each tool as one line).", "",
             "## Training", "",
             f"`tools/train_demo.py --arch oss --steps {a['steps']} --seq {a['seq']} --batch {a['batch']} --lr {a['lr']} "
             f"--copy-weight {a['copy_weight']:g} --seed {a['seed']}` from `--init {Path(a['init']).name}` "
             f"(tools/oss_demo.py transplants it): {log['steps']} steps, {log['tokens']:,} tokens, {log['minutes']} "
             f"minutes on 2 CPU cores. Loss on what the model writes: {losses[0]} at step 1, {losses[-1]} at the end.",
             "", "## Held-out numbers (tools/eval_demo.py, through FreeToken's CPU path)", "",
             f"Mean negative log-likelihood: {ev['heldout_loss_agent']} nats per assistant token of held-out "
             f"conversations, {ev['heldout_loss_code']} per token of held-out code.", "",
             "Given the tools and a request that needs one, the first output (the grammar row: harmony's tool-call "
             "grammar, what `tool_choice: required` enforces):", "", *_calls_table(ev), "",
             f"After the expected call and its result, the final message equals the expected answer in "
             f"{_pct(ev['answers']['exact'])} of {ev['answers']['n']} cases.", "", "## Samples", ""]
    for smp in ev["answers"]["samples"]:
        lines += [f"- {smp['harness']}: *{smp['request']}* → `{' '.join(smp['reply'].split())[:160]}`"]
    (model_dir / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "quantize":
        sys.exit("usage: python tools/oss_demo.py quantize MODEL_DIR  (experts to MXFP4 in place)")
    quantize_experts(Path(sys.argv[2]))
