"""Train a built-in model (dev time only: torch and transformers, never a runtime or CI need).

    /path/to/venv-with-torch/bin/python tools/train_demo.py --out /tmp/tiny-agent-moe
        [--init DIR | none] [--steps 2400] [--seed 0] [--seq 1024]

Corpus (tools/agent_corpus.py, deterministic for --seed): synthetic agent conversations rendered
with the compact agent template (tools/agent_template.jinja) by the packaged tokenizer, the loss
on the assistant's tokens only; and Python standard-library sources, the loss on every token, as
"Write Python code." chats (--code-share of the sequences). Sequences of --seq tokens packed
from whole documents. --init starts from a Hugging Face directory of the same architecture:
the built-in tiny-agent-moe was trained from its predecessor `tiny-coder-moe` (a Qwen3-MoE trained
on the standard library; in git at 4b99d58:freetoken/data/tiny-coder-moe, restored there by
`git restore -s 4b99d58 freetoken/data/tiny-coder-moe`, the default --init); `none` trains SHAPE
from scratch. Writes the Hugging Face directory (bf16 safetensors, tokenizer with the agent template)
and train_log.json; tools/eval_demo.py then measures it and writes the README's numbers.
Deterministic for a seed on one machine: one data order, torch.manual_seed, a step-based
schedule, 2 threads (--minutes only cuts a run short, and says so). --arch oss trains the built-in
gpt-oss (tools/oss_demo.py: harmony's markers and template, transplanted from tiny-agent-moe); the
packaged one then had its experts written as MXFP4 (`python tools/oss_demo.py quantize DIR`).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import agent_corpus as corpus  # noqa: E402
import oss_demo  # noqa: E402

TEMPLATE = ROOT / "tools" / "agent_template.jinja"
PREDECESSOR = ROOT / "freetoken" / "data" / "tiny-coder-moe"    # restored from git (docstring)
ASSISTANT = "<|im_start|>assistant\n"


def tokenizer(arch: str = "moe", out: Path | None = None):
    """The packaged vocabulary with the compact agent template; for --arch oss, harmony's markers
    added and the harmony template (the tokenizer files written to out)."""
    from freetoken.models.demo import synth_tokenizer_dir
    from freetoken.tokenizer import Tokenizer
    if arch == "oss":
        return Tokenizer.from_dir(oss_demo.write_tokenizer(out))
    tok = Tokenizer.from_dir(synth_tokenizer_dir())
    tok.set_chat_template(TEMPLATE.read_text())
    return tok


def masked(tok, text: str, copy_weight: float = 1.0) -> tuple[list[int], list[float]]:
    """(ids, loss weights): 1 on each assistant turn's tokens after its header, through <|im_end|>;
    copy_weight on its tokens between backticks (what the answer copies from a tool result: a few
    tokens of each conversation, and the skill a 4-layer model learns last); 0 elsewhere."""
    ids, weights = [], []
    head = tok.encode(ASSISTANT)
    for i, part in enumerate(text.split(ASSISTANT)):
        if i:
            ids += head
            weights += [0.0] * len(head)
        encoding = tok._tok.encode(part, add_special_tokens=False)      # ids with character offsets
        ids += encoding.ids
        end = part.find("<|im_end|>")
        end = len(part) if end < 0 else end + len("<|im_end|>")
        quoted = _between_backticks(part[:end])
        weights += [0.0 if i == 0 or a >= end else copy_weight if quoted[a] else 1.0 for a, _ in encoding.offsets]
    return ids, weights


def _between_backticks(text: str) -> list[bool]:
    """Per character: inside an inline `...` span on one line (the backticks and ``` fences
    excluded), the answer's copied text."""
    flags = [False] * (len(text) + 1)
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        flags[m.start(1):m.end(1)] = [True] * (m.end(1) - m.start(1))
    return flags


def documents(tok, rng: random.Random, n_agent: int, n_code: int, copy_weight: float = 1.0, harmony=False):
    """Yield (ids, weights) documents, agent conversations and code chats interleaved at random."""
    files = corpus.Files(rng, corpus.stdlib_files())
    hs = corpus.harnesses()
    kinds = ["agent"] * n_agent + ["code"] * n_code
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "agent":
            c = corpus.conversation(rng, files, hs)
            messages = oss_demo.harmony_messages(c["messages"]) if harmony else c["messages"]
            text = tok.apply_chat_template(messages, tools=c["tools"], add_generation_prompt=False)
        else:
            _, code = files.source()
            text = tok.apply_chat_template([{"role": "user", "content": "Write Python code."},
                                            {"role": "assistant", "content": code}], add_generation_prompt=False)
        weight = copy_weight if kind == "agent" else 1.0
        yield oss_demo.masked(tok, text, weight, _between_backticks) if harmony else masked(tok, text, weight)


def pack(docs, seq: int, eot: int):
    """Sequences of exactly seq + 1 tokens (inputs, loss weights; 0 where the loss is off)."""
    buf_ids, buf_w = [], []
    for ids, weights in docs:
        buf_ids += ids + [eot]
        buf_w += weights + [0.0]
        while len(buf_ids) >= seq + 1:
            yield buf_ids[:seq + 1], buf_w[:seq + 1]
            buf_ids, buf_w = buf_ids[seq:], buf_w[seq:]


SHAPE = dict(hidden=256, layers=4, experts=16, top_k=4, moe_intermediate=128, heads=8, kv_heads=2,
             head_dim=32, vocab=4096, max_positions=2048)       # tiny-coder-moe's, kept by its successor


HYBRID = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=16,
              num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
              rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=2048, router_aux_loss_coef=0.01,
              bos_token_id=None, eos_token_id=2, pad_token_id=0)    # the Qwen3.5/3.6-MoE layout, demo-sized


def build_model(init: str, torch, arch: str = "moe", tok=None):
    """The model to train: --init's weights and config, or (`none`) from scratch: SHAPE for the
    Qwen3-MoE, HYBRID for the Gated DeltaNet hybrid (--arch hybrid; transformers' Qwen3.5-MoE);
    --arch oss: gpt-oss (tools/oss_demo.py)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    if arch == "hybrid":
        return build_hybrid(init, torch)
    if arch == "oss":
        return oss_demo.build(init, tok, torch)
    if init == "none":
        from freetoken.models.demo import random_config
        cfg = Qwen3MoeConfig(**{**random_config(**SHAPE), "router_aux_loss_coef": 0.01, "decoder_sparse_step": 1,
                                "mlp_only_layers": []})
        cfg.output_router_logits = True
        return Qwen3MoeForCausalLM(cfg), cfg
    cfg = Qwen3MoeConfig.from_pretrained(init)
    cfg.output_router_logits = True               # the router's load-balancing loss
    return Qwen3MoeForCausalLM.from_pretrained(init, config=cfg, dtype=torch.float32), cfg


def build_hybrid(init: str, torch):
    """--init a Qwen3.5-MoE directory (continue it), a Qwen3-MoE one (transplant its embedding,
    head, router and experts: tools/hybrid_init.py), or none."""
    from transformers import AutoConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeForCausalLM
    donor = AutoConfig.from_pretrained(init).architectures[0] if init != "none" else None
    if donor == "Qwen3_5MoeForCausalLM":
        cfg = Qwen3_5MoeTextConfig.from_pretrained(init)
        cfg.output_router_logits = True
        return Qwen3_5MoeForCausalLM.from_pretrained(init, config=cfg, dtype=torch.float32), cfg
    cfg = Qwen3_5MoeTextConfig(**HYBRID)
    cfg.output_router_logits = True
    model = Qwen3_5MoeForCausalLM(cfg)
    if donor is not None:
        from hybrid_init import transplant
        copied = transplant(model, Qwen3MoeForCausalLM.from_pretrained(init, dtype=torch.float32), torch)
        print(f"hybrid: {len(copied)} tensors copied from {init} (tools/hybrid_init.py)", flush=True)
    return model, cfg


def train(args) -> dict:
    import torch
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tok, rng = tokenizer(args.arch, Path(args.out)), random.Random(args.seed)
    model, cfg = build_model(args.init, torch, args.arch, tok)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    n_code = int(args.docs * args.code_share)
    docs = documents(tok, rng, args.docs - n_code, n_code, args.copy_weight, harmony=args.arch == "oss")
    stream = pack(docs, args.seq, eot=0)
    log, t0, step = [], time.time(), 0
    while step < args.steps:
        if time.time() - t0 > 60 * args.minutes:
            print(f"stopped at --minutes {args.minutes} after {step} of {args.steps} steps", flush=True)
            break
        batch = [next(stream, None) for _ in range(args.batch)]
        if batch[-1] is None:
            break
        x = torch.tensor([b[0][:-1] for b in batch])
        y = torch.tensor([b[0][1:] for b in batch])
        w = torch.tensor([b[1][1:] for b in batch])
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        out = model(input_ids=x, labels=None)
        logits = out.logits.float()
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                      reduction="none")
        loss = (per_token * w.reshape(-1)).sum() / w.sum().clamp(min=1e-6)
        total = loss + cfg.router_aux_loss_coef * out.aux_loss if out.aux_loss is not None else loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 20 == 0 or step == 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "lr": round(lr, 6),
                        "minutes": round((time.time() - t0) / 60, 2)})
            print(json.dumps(log[-1]), flush=True)
    return {"steps": step, "tokens": step * args.batch * args.seq, "minutes": round((time.time() - t0) / 60, 2),
            "log": log, "model": model, "tok": tok}


def save(result: dict, args) -> None:
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = result.pop("model").to(torch.bfloat16)
    model.config.output_router_logits = False
    model.save_pretrained(out, safe_serialization=True)
    result.pop("tok")
    if args.arch == "oss":                 # its tokenizer files again: save_pretrained wrote a generation config
        oss_demo.write_tokenizer(out)
        (out / "train_log.json").write_text(json.dumps({"args": vars(args), **result}, indent=1) + "\n")
        print(f"written {out}")
        return
    src = ROOT / "freetoken" / "data" / "synth-tokenizer"
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "train_log.json").write_text(json.dumps({"args": vars(args), **result}, indent=1) + "\n")
    print(f"written {out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", choices=("moe", "hybrid", "oss"), default="moe",
                    help="moe: Qwen3-MoE (tiny-agent-moe); hybrid: Qwen3.5-MoE layout (Gated DeltaNet + gated attention); "
                         "oss: gpt-oss speaking harmony (tiny-agent-oss)")
    ap.add_argument("--init", default=None, help="a Hugging Face directory to start from, or none (default: the "
                                                 "predecessor for moe, the packaged tiny-agent-moe for hybrid and oss; "
                                                 "oss needs a directory)")
    ap.add_argument("--steps", type=int, default=2400, help="optimizer steps of --batch x --seq tokens")
    ap.add_argument("--minutes", type=float, default=60, help="stop early past this wall time (logged)")
    ap.add_argument("--docs", type=int, default=200_000, help="documents drawn (the run stops at --minutes)")
    ap.add_argument("--code-share", type=float, default=0.15)
    ap.add_argument("--copy-weight", type=float, default=1.0,
                    help="loss weight of the answer's tokens between backticks (copied from a tool result)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.arch == "oss" and args.init == "none":
        ap.error("--arch oss starts from a model directory (a Qwen3-MoE to transplant or a gpt-oss to continue)")
    if args.init is None:
        args.init = str(PREDECESSOR if args.arch == "moe" else ROOT / "freetoken" / "data" / "tiny-agent-moe")
    np.random.seed(args.seed)
    save(train(args), args)


if __name__ == "__main__":
    main()
