"""README.md of a built-in model from what tools/train_demo.py logged (train_log.json) and what
tools/eval_demo.py measured (eval.json): architecture, training, held-out numbers, samples."""
from __future__ import annotations

import json
from pathlib import Path


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _calls_table(ev: dict) -> list[str]:
    rows = ["| decoding | harness | n | well-formed call | of a listed tool | schema-valid arguments | the expected call |",
            "|---|---|---|---|---|---|---|"]
    for label, key in (("greedy", "tool_calls"), ("greedy, tool-call grammar", "tool_calls_constrained")):
        t = ev[key]
        for name, r in [("all", t), *sorted(t["by_harness"].items())]:
            rows.append(f"| {label} | {name} | {r['n']} | {_pct(r['well_formed'])} | {_pct(r['listed'])} | "
                        f"{_pct(r['schema_valid'])} | {_pct(r['exact'])} |")
    return rows


def _stage1(model_dir: Path) -> list[str]:
    """The earlier stages, when the model was trained in several (train_log_stageN.json)."""
    out = []
    for n, path in enumerate(sorted(model_dir.glob("train_log_stage*.json")), 1):
        log = json.loads(path.read_text())
        a, losses = log["args"], [r["loss"] for r in log["log"]]
        out.append(f"Stage {n}: `tools/train_demo.py --steps {a['steps']} --lr {a['lr']} --seed {a['seed']}` from "
                   f"`--init {Path(a['init']).name}` ({log['steps']} steps, {log['tokens']:,} tokens, "
                   f"{log['minutes']} minutes; loss {losses[0]} to {losses[-1]}).")
    if out:
        out = ["The run above is the last of several stages, each with the corpus of its day:", ""] + \
              [f"- {line}" for line in out] + [
              "", "Stage 1's corpus drew words and directories from a list of 40 words; stage 2's from 12,568 words "
              "of the standard library (so that the model copies rather than recalls); stage 3's renders "
              "Claude Code's Read results as it really sends them (`N<tab>line`) and draws Claude Code's tool "
              "list twice as often as the others; stage 4's passes paths as the user wrote them (Claude Code "
              "resolves a relative one), gives Codex's command output its captured header and makes one word "
              "in ten random letters and digits; stage 5's answers what it copies from a tool result between "
              "backticks, so that the answer repeats the result's tokens, and adds aider's conversations "
              "(tools/aider_corpus.py); stage 6 ran on it with reading tasks weighted up; stage 7's never draws "
              "the live launch tests' first words (HELD_OUT_WORDS) and makes a third of the note words "
              "pseudo-words of two or three syllables (split by the tokenizer as a user's words are: t|un|nel); "
              "the last one's (the current tools/agent_corpus.py) makes a quarter of them pseudo-words and a "
              "quarter one to three of the tokenizer's 1,603 letters-only pieces joined (so that every piece is "
              "once a word to copy); stages 7 and 8 weigh the copied tokens between backticks `--copy-weight` "
              "times in the loss.", ""]
    return out


def _sampling(model_dir: Path) -> list[str]:
    gen = json.loads((model_dir / "generation_config.json").read_text())
    if gen.get("do_sample") is not False:
        return []
    return ["## Sampling", "",
            "`generation_config.json` says `do_sample: false`, so a server answers a request that sets no sampling "
            "fields (Claude Code's and Codex's) greedily; a request's own temperature still applies. Replaying the "
            "harnesses' second turns of the live launch tests with their ten first words (`tools/copy_replay.py`, "
            "2026-12-07), the first word came back right 9, 9 and 7 times of 10 (Claude Code, Codex, aider) greedily, "
            "6, 6 and 5 at temperature 1, and 8, 8 and 6 with Qwen3's recommended 0.7 / top-p 0.8 / top-k 20: "
            "a model this small samples its copying mistakes.", ""]


def _architecture(cfg: dict) -> list[str]:
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    moe = (f"{experts} routed experts top-{cfg['num_experts_per_tok']} (width {cfg['moe_intermediate_size']}) in "
           f"every layer")
    common = (f"vocabulary {cfg['vocab_size']}, {cfg['max_position_embeddings']} positions, bf16. The tokenizer is "
              "tiny-coder-moe's (byte-level BPE, ChatML and Qwen3's tool and think tokens).")
    if "layer_types" not in cfg:
        return [f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} query / "
                f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, {moe}, {common}"]
    kinds = ", ".join("GDN" if t == "linear_attention" else "attention" for t in cfg["layer_types"])
    return [f"The Qwen3.5/3.6-MoE layout (`Qwen3_5MoeForCausalLM`), demo-sized: {cfg['num_hidden_layers']} layers "
            f"({kinds}), hidden {cfg['hidden_size']}. Gated DeltaNet layers: {cfg['linear_num_key_heads']} key / "
            f"{cfg['linear_num_value_heads']} value heads of {cfg['linear_key_head_dim']}, causal conv of "
            f"{cfg['linear_conv_kernel_dim']}; the full-attention layer is gated (a sigmoid gate per head), "
            f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, rotary on "
            f"{cfg['rope_parameters'].get('partial_rotary_factor', 1.0):g} of each head; {moe} plus a gated shared "
            f"expert (width {cfg['shared_expert_intermediate_size']}); {common}"]


def _hybrid_init(cfg: dict, a: dict, log: list) -> list[str]:
    if "layer_types" not in cfg:
        return []
    under = next((r["step"] for r in log if r["loss"] < 2), None)
    return [f"Started from `{Path(a['init']).name}` (tools/hybrid_init.py): its embedding, output head, router, "
            "routed experts, norms and attention weights (layer 3) were copied; the Gated DeltaNet layers, the "
            "attention output gate and the shared expert started so as to add nothing (zero output projections) and "
            "were learned. Copied as they are, the routed experts lose their meaning without the attention of layers "
            f"0-2 (loss {log[0]['loss']} at step 1)" + (f"; the loss is under 2 from step {under}." if under else "."),
            ""]


def write_card(model_dir: Path, ev: dict) -> None:
    log = json.loads((model_dir / "train_log.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    a = log["args"]
    losses = [r["loss"] for r in log["log"]]
    copy = f" --copy-weight {a['copy_weight']:g}" if a.get("copy_weight", 1.0) != 1.0 else ""
    kind = "Gated DeltaNet hybrid MoE" if "layer_types" in cfg else "Qwen3-MoE"
    lines = [f"# {model_dir.name}", "",
             f"A tiny {kind} causal language model that acts like an agent's model: given a harness's tools",
             "and a request that needs one, it emits a `<tool_call>` of a listed tool with arguments taken from the",
             "request, reads the `<tool_response>`, and answers with what it found. Trained by `tools/train_demo.py`",
             "(FreeToken's repository) on synthetic agent conversations in the style of Claude Code, Codex CLI and a",
             "generic tool set, plus Python standard-library code. Far too small to be useful as an assistant; it",
             "exists so that a harness can be shown doing real round trips against FreeToken with no network and no GPU.",
             "", "## Architecture", "", *_architecture(cfg), "",
             "## Chat template", "",
             "Qwen3-style ChatML, compact so that a 2048-position model can serve harnesses whose own prompts run to",
             "tens of thousands of tokens: the leading system message renders as its first paragraph (at most 320",
             "characters, header lines starting `x-` skipped) plus any line naming the working directory, later",
             "system messages not at all; each tool as one line `- Name(param, optional?, ...)`; `<system-reminder>`",
             "spans inside user text are dropped; Codex's `<environment_context>` message renders as its `cwd`.",
             "Claude Code's first request (24 tools, 64 KB of schemas) renders to 575 tokens. Calls, results and thinking are rendered as Qwen3 does (`tools/agent_template.jinja`).",
             "", "## Training", "",
             f"`tools/train_demo.py{' --arch hybrid' if a.get('arch') == 'hybrid' else ''} --steps {a['steps']} "
             f"--seq {a['seq']} --batch {a['batch']} --lr {a['lr']} "
             f"--seed {a['seed']} --code-share {a['code_share']}"
             f"{copy}`, from `--init {Path(a['init']).name}`: "
             f"{log['steps']} steps, {log['tokens']:,} tokens, {log['minutes']} minutes on 2 CPU cores (torch "
             f"{a.get('torch', '2.13.0')}, CPU). Loss on the assistant's tokens (all tokens of code documents): "
             f"{losses[0]} at step 1, {losses[len(losses) // 2]} half way, {losses[-1]} at the end.", "",
             *_hybrid_init(cfg, a, log['log']), *_stage1(model_dir),
             "## Held-out numbers (tools/eval_demo.py, through FreeToken's CPU path)", "",
             f"Mean negative log-likelihood: {ev['heldout_loss_agent']} nats per assistant token of held-out "
             f"conversations (a seed training never drew), {ev['heldout_loss_code']} per token of held-out code (15 "
             "standard-library files no model trained on).", "",
             "Given the tools and a request that needs one, the first output:", "", *_calls_table(ev), "",
             f"After the expected call and its result, the reply equals the expected answer in "
             f"{_pct(ev['answers']['exact'])} of {ev['answers']['n']} cases.", "",
             "The held-out conversations come from the same generator as the training ones (other file names,",
             "contents, working directories and orderings; the same kinds of request). The model learned the",
             "call formats and which tool a request needs (the expected call: "
             f"{_pct(ev['tool_calls']['by_harness']['claude']['exact'])} of Claude Code requests, whose Read takes "
             f"the path as the user wrote it, {_pct(ev['tool_calls']['by_harness']['generic']['exact'])} of generic "
             "ones); copying is its weak point: most wrong answers are words copied wrongly from the tool result "
             "(one held-out word in ten is random letters and digits). Routing locality on held-out code, chats and agent sessions: "
             "docs/performance.md and bench/traces/ (bench/record_traces.py `--model`).", "",
             *_sampling(model_dir), "## Samples", ""]
    for smp in ev["answers"]["samples"]:
        reply = " ".join(smp["reply"].split("</think>")[-1].split())[:160]      # the answer, on one line
        lines += [f"- {smp['harness']}: *{smp['request']}* → after the call and its result: `{reply}`"]
    (model_dir / "README.md").write_text("\n".join(lines) + "\n")
