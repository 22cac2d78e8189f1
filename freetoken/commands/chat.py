"""``chat``: an interactive chat in the terminal, streamed as it generates.

The conversation is a list of messages rendered with the model's chat template each turn
(LLM.chat_prompt). Ctrl-C while a reply streams stops that reply: the first press asks the reply
to stop at its next piece of text (the stream generator is closed, so the engine aborts the
request and frees its KV slots); a second press interrupts the engine step at once. Ctrl-C or
Ctrl-D at the prompt leaves. Ctrl-C is always the chat's own: `run` takes SIGINT back from
whatever state the process inherited (see own_ctrl_c).
"""
from __future__ import annotations

import signal
import sys

from freetoken.flags import add_config_flags, config_from_args
from freetoken.log import held
from freetoken.commands.generate import add_sampling_flags

PROMPT = "you> "
HELP = """commands:
  /reset   start a new conversation (the expert cache stays warm)
  /stats   MoE expert-cache counters and KV pool occupancy
  /help    this text
  /exit    leave (also Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C while a reply is streaming stops that reply."""
DEMO_HINT = 'The demo model was trained to answer "Write Python code." with code; try that.'


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal (history, /reset, /stats)")
    add_sampling_flags(p, max_tokens=512, temperature=0.7, top_p=0.95)
    add_config_flags(p)      # includes --seed: the seed of the session's sequence of reply seeds
    p.set_defaults(run=run)


def own_ctrl_c() -> None:
    """Give SIGINT back to Python's KeyboardInterrupt and unblock it in this thread.

    A process starts with the SIGINT disposition of its parent when that is "ignore" (exec keeps an
    ignored signal ignored, and Python then leaves it so), and with the parent's blocked-signal
    mask. Nobody has to mean it: `cmd &` in a shell without job control (a script, `bash -c`, a
    tool that runs commands in the background) starts cmd with SIGINT ignored, and everything cmd
    starts inherits that, e.g. a test run launched so and the chat it drives. Such a chat still
    stopped replies (StopOnInterrupt installs its own handler) but was deaf to Ctrl-C at its
    prompt, where input() relies on the default handler. The chat is interactive: its Ctrl-C
    means what the module doc says, whoever started it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class StopOnInterrupt:
    """SIGINT handler for the length of one reply: the first press sets `requested`; a second
    press raises KeyboardInterrupt where the main thread is (possibly inside an engine step)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class ChatSession:
    """The conversation state and one engine; `turn(text)` streams a reply to `out`."""

    def __init__(self, llm, params, system: str | None, template_kwargs: dict, out=sys.stdout):
        self.llm, self.params, self.system = llm, params, system
        self.template_kwargs, self.out = template_kwargs, out
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, text: str) -> str:
        """Add a user message, stream the reply; returns how it ended (stop, length, stopped...)."""
        from freetoken.engine.request import InvalidRequest
        self.messages.append({"role": "user", "content": text})
        try:
            prompt = self.llm.chat_prompt(self.messages, **self.template_kwargs)
            reply, how = self._stream(prompt)
        except InvalidRequest as e:
            self.messages.pop()
            self.say(f"[error] {e}; /reset starts a new conversation")
            return "error"
        self.messages.append(reply)
        return how

    def _stream(self, prompt: list[int]) -> tuple[dict, str]:
        """(the assistant message, how the reply ended)."""
        from freetoken.commands.channels import ReplyText
        reply = ReplyText(self.llm, self.out)      # a harmony model's channels shown apart
        stream = self.llm.stream(prompt, reply.params(self.params))
        how = None
        with StopOnInterrupt() as stop, held():    # log lines after the reply, not inside it
            try:
                for text in stream:
                    reply.write(text)
                    if stop.requested:
                        how = "stopped"
                        break
            except KeyboardInterrupt:         # second Ctrl-C, inside an engine step
                how = "interrupted"
            finally:
                stream.close()                # aborts the request and frees its KV slots
            reply.finish()                    # a cut-off call's log line after the reply too
        self.out.write("\n")
        self._summary(how)
        if how == "interrupted":              # the step may have stopped halfway: start cold
            self.llm.core.moe.reset()
        return reply.message(), how or self.llm.last_output.finish_reason

    def _summary(self, how: str | None) -> None:
        if how == "stopped":
            self.say("[stopped]")
        elif how == "interrupted":
            self.say("[interrupted; expert cache reset]")
        else:
            out = self.llm.last_output
            m = out.metrics
            self.say(f"[{m['generated_tokens']} tokens, {m['decode_tok_s']:.0f} tok/s, "
                      f"finish {out.finish_reason}]")

    def stats_text(self) -> str:
        stats = self.llm.stats()
        moe, kv = stats["moe"], stats["kv"]
        lines = [f"MoE backend {moe['backend']}, {moe['slots']} slots, policy {moe['policy']}, "
                 f"prefill calls {moe['prefill_calls']}",
                 "  total: " + _counters(moe["total"])]
        lines += [f"  layer {j}: " + _counters(c) for j, c in enumerate(moe["layers"])]
        cache = self.llm.core.prefix_cache
        cached, locked = (cache.size, cache.protected_size) if cache is not None else (0, 0)
        held = kv["slots"] - kv["free"] - cached
        lines.append(f"KV pool: {kv['slots']} slots, {kv['free']} free, {cached} cached prefix "
                     f"tokens ({locked} locked), {held} held by requests")
        lines.append(f"conversation: {len(self.messages)} messages")
        return "\n".join(lines)

    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


def _counters(c: dict) -> str:
    return " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items())


def command(session: ChatSession, line: str) -> bool:
    """Run a /command; False when the session should end."""
    name = line.split()[0].lower()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        session.say("[new conversation]")
    elif name == "/stats":
        session.say(session.stats_text())
    elif name == "/help":
        session.say(HELP)
    else:
        session.say(f"unknown command {name}; /help lists them")
    return True


def repl(session: ChatSession) -> None:
    """Read lines until /exit, Ctrl-D or Ctrl-C at the prompt."""
    while True:
        try:
            line = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            session.out.write("\n")
            return
        if not line:
            continue
        if line.startswith("/"):
            if not command(session, line):
                return
            continue
        session.turn(line)


def run(args) -> int:
    own_ctrl_c()             # first: Ctrl-C during a long first load ends it too (cli.main: exit 130)
    from freetoken.engine.llm import LLM
    from freetoken.engine.request import SamplingParams
    try:
        import readline  # noqa: F401  (line editing and arrow-key history for input())
    except ImportError:
        pass
    llm = LLM(**config_from_args(args).__dict__)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, ignore_eos=args.ignore_eos)
    kwargs = {"enable_thinking": False} if args.no_think else {}
    session = ChatSession(llm, params, args.system, kwargs)
    cfg = llm.core.model_config
    session.say(f"{llm.core.model_name}: {cfg.num_layers} layers, {cfg.num_experts} experts, "
                 f"top-{cfg.num_experts_per_tok}. /help for commands, Ctrl-D to leave.")
    if args.model is None:
        session.say(DEMO_HINT)
    try:
        repl(session)
    finally:
        llm.core.close()
    return 0
