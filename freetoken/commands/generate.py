"""``generate``: stream one completion to stdout, then a summary line on stderr."""
from __future__ import annotations

import json
import sys

from freetoken.flags import add_config_flags, config_from_args
from freetoken.log import held


DEFAULT_CHAT = "Write Python code."   # what the demo model was trained to answer


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", help="raw text prompt (no chat template)")
    what.add_argument("--chat", metavar="MESSAGE", help="one user message, rendered with the chat "
                      f"template (with neither flag: --chat {DEFAULT_CHAT!r})")
    add_sampling_flags(p, max_tokens=128, temperature=0.0, top_p=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print MoE cache counters at the end")
    p.add_argument("--record-routing", metavar="FILE", help="write every MoE layer's routed ids per step")
    add_config_flags(p)
    p.set_defaults(run=run)


def add_sampling_flags(p, *, max_tokens: int, temperature: float, top_p: float) -> None:
    """The chat-template and sampling flags that generate and chat share."""
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--no-think", action="store_true", help="render the chat template with enable_thinking=False")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})")
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default: {temperature})")
    p.add_argument("--top-p", type=float, default=top_p, help=f"nucleus sampling mass (default: {top_p})")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0: all (default: 0)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def run(args) -> int:
    from freetoken.engine.llm import LLM
    from freetoken.engine.request import SamplingParams
    config = config_from_args(args)
    llm = LLM(**{k: v for k, v in config.__dict__.items()})
    if args.record_routing:
        llm.core.record_routing()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    prompt = args.prompt
    if prompt is None and args.chat is None:
        print(f"[freetoken] no --prompt or --chat given: using --chat {DEFAULT_CHAT!r}", file=sys.stderr)
        args.chat = DEFAULT_CHAT
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.chat})
        kwargs = {"enable_thinking": False} if args.no_think else {}
        prompt = llm.chat_prompt(messages, **kwargs)
    from freetoken.commands.channels import ReplyText
    reply = ReplyText(llm, sys.stdout, chat=args.chat is not None)     # a --prompt's text shown raw
    with held():                              # log lines after the text, not inside it
        for text in llm.stream(prompt, reply.params(params)):
            reply.write(text)
        reply.finish()
        sys.stdout.write("\n")
    out = llm.last_output
    m = out.metrics
    print(f"[freetoken] prompt tokens {m['prompt_tokens']} | generated tokens {m['generated_tokens']} | "
          f"prefill {m['prefill_tok_s']:.1f} tok/s | decode {m['decode_tok_s']:.1f} tok/s | "
          f"finish {out.finish_reason}", file=sys.stderr)
    if args.stats:
        print_stats(llm.stats())
    if args.record_routing:
        llm.core.save_routing(args.record_routing)
    return 0


def print_stats(stats: dict) -> None:
    moe = stats["moe"]
    total = moe.get("total", {})
    print("[freetoken] MoE " + " | ".join(f"{k} {v}" for k, v in total.items()), file=sys.stderr)
    for layer, counters in enumerate(moe.get("layers", [])):
        print(f"[freetoken]   layer {layer}: " + " ".join(f"{k}={v}" for k, v in counters.items()),
              file=sys.stderr)
    print("[freetoken] stats " + json.dumps({"kv": stats["kv"]}), file=sys.stderr)
