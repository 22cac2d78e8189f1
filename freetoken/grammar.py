"""Constrained decoding (structured output) with llguidance, a dependency (an install without it
refuses what needs it with a 400 naming it); the only module that imports it, lazily. See
docs/constrained-decoding.md.

A grammar is Lark text (llguidance's dialect: ``%json {schema}`` sub-rules, special tokens by
name such as ``<tool_call>``). ``Grammars`` is one per model: it builds the llguidance tokenizer
once (at engine start-up, on a thread) over the logits width, so padding ids past the tokenizer are always masked
off, with the model's stop ids as end of sequence. ``Matcher`` is one per request: it writes its
row of the allowed-token bitmask (int32, bit t & 31 of word t >> 5, the sampling op's layout) and
is advanced with each sampled token.
"""
from __future__ import annotations

import functools
import json
import threading
import time

INSTALL_HINT = "pip install 'freetoken[grammar]'"          # llguidance: a dependency this install lacks


class GrammarUnavailable(RuntimeError):
    """llguidance is not installed."""


class GrammarError(ValueError):
    """The grammar (or JSON schema) does not compile; the message quotes llguidance."""


def available() -> bool:
    try:
        _llg()
    except GrammarUnavailable:
        return False
    return True


def _llg():
    try:
        import llguidance
    except ImportError:
        raise GrammarUnavailable(f"constrained decoding is not installed: {INSTALL_HINT}") from None
    return llguidance


COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict | None = None) -> str:
    """Lark text for one JSON value matching ``schema``; None means any JSON object. The layout is
    fixed to json.dumps' (", " and ": ", no other whitespace): a free-whitespace grammar lets a
    weak model spend its whole budget on newlines. A schema's own "x-guidance" options win."""
    schema = {"type": "object"} if schema is None else dict(schema)
    schema["x-guidance"] = {**COMPACT, **(schema.get("x-guidance") or {})}
    return "start: %json " + json.dumps(schema, separators=(",", ":")) + "\n"


# free text that does not spell the call opener out of ordinary tokens (the opener itself is a
# special token, which text never matches)
_FREE_TEXT = "TEXT: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"


def tool_call_grammar(tools: list[dict], parallel: bool = True, free_text: bool = False) -> str:
    """Lark text for Qwen3's JSON tool-call form, one or more (``parallel``) of
    ``<tool_call>\\n{"name": <one of tools>, "arguments": <its parameters>}\\n</tool_call>``
    (the wrapper tokens are the special tokens). ``tools`` are OpenAI function tools
    (``{"type": "function", "function": {"name", "parameters"?}}``). ``free_text`` (tool_choice
    auto): text first, then calls or none; the grammar only binds once the model opens a call, as
    llama.cpp's and vLLM's triggered tool grammars do, so a call it starts is always well-formed."""
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"anyOf": options} if len(options) > 1 else options[0]
    # lenient: keywords llguidance does not implement (Claude Code's TaskCreate uses
    # propertyNames) are ignored instead of failing the whole grammar; the harness validates the
    # arguments it receives, and every other keyword is still enforced
    schema["x-guidance"] = {**COMPACT, "lenient": True}
    calls = 'call ("\\n" call)*' if parallel else "call"
    start = "start: TEXT? calls?\n" + _FREE_TEXT if free_text else "start: calls\n"
    return (f"{start}calls: {calls}\n"
            'call: <tool_call> "\\n" args "\\n" </tool_call>\n'
            "args: %json " + json.dumps(schema, separators=(",", ":")) + "\n")


# harmony (gpt-oss): an optional analysis message before the one the grammar forces; the markers
# are special tokens (by name), which the analysis text never matches, so it runs to <|end|>
_HARMONY_THOUGHT = ('thought: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"\n'
                    "THOUGHT: /(.|\\n)*/\n")


# tool_choice auto in harmony: any number of analysis or plain commentary messages, then the final
# answer or a call. Every message body ends only at a marker (a special token), so the channel
# header is the one place a call can open, and it is a closed choice: no free text to exclude
_HARMONY_AUTO = ('start: (aside <|end|> <|start|> "assistant")* (final | call)\n'
                 'aside: <|channel|> ("analysis" | "commentary") <|message|> BODY\n'
                 'final: <|channel|> "final" <|message|> BODY\n'
                 "BODY: /(.|\\n)*/\n")


def harmony_tool_call_grammar(tools: list[dict], auto: bool = False) -> str:
    """Lark text for one harmony tool call, ``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>`` and the arguments as JSON of the tool's parameters (the model's
    stop token <|call|> then ends the reply: one call a turn, as harmony has it), after an optional
    analysis message. ``tools`` as tool_call_grammar's (all of them, or the forced one). The
    arguments are compact JSON (no spaces), as harmony's own examples write them. ``auto``
    (tool_choice auto): the call is one of the reply's two possible ends, the final message the
    other, after any analysis and commentary messages; a call the model opens names a listed tool
    and holds to its schema."""
    rules = []
    for i, t in enumerate(tools):
        schema = dict(t["function"].get("parameters") or {"type": "object"})
        schema["x-guidance"] = {**COMPACT, "item_separator": ",", "key_separator": ":", "lenient": True}
        rules += [f'fn{i}: {json.dumps(t["function"]["name"])} " " <|constrain|> "json" <|message|> args{i}',
                  f"args{i}: %json " + json.dumps(schema, separators=(",", ":"))]
    names = " | ".join(f"fn{i}" for i in range(len(tools)))
    head = _HARMONY_AUTO if auto else "start: thought? call\n" + _HARMONY_THOUGHT
    return head + f'call: <|channel|> "commentary to=functions." ({names})\n' + "\n".join(rules) + "\n"


def harmony_final_grammar(schema: dict | None = None) -> str:
    """Lark text for a harmony reply whose final message is one JSON value (json_grammar's), after
    an optional analysis message: ``<|channel|>final<|message|>`` then the JSON."""
    value = json_grammar(schema)[len("start: "):]
    return "start: thought? final\n" + _HARMONY_THOUGHT + 'final: <|channel|> "final" <|message|> ' + value


def xml_tool_call_grammar(tools: list[dict], parallel: bool = True, free_text: bool = False) -> str:
    """Lark text for Qwen3-Coder's XML tool-call form (also Qwen3.5's): ``<tool_call>\\n<function=NAME>\\n``,
    then each parameter as ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` in the order of the
    schema's properties (required ones present, no others), ``</function>\\n</tool_call>``. A
    string value is free text up to ``\\n</parameter>``; any other is JSON of its schema.
    ``parallel`` and ``free_text`` as for tool_call_grammar."""
    rules, names = [], []
    for i, t in enumerate(tools):
        schema, opener = t["function"].get("parameters") or {}, "<function=%s>\n" % t["function"]["name"]
        required, params = set(schema.get("required") or ()), []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            opens, (value, closes) = json.dumps("<parameter=%s>\n" % key), _xml_value(f"v{i}_{j}", prop)
            rules += [f"p{i}_{j}: {opens} v{i}_{j} {closes}", value]
            params.append(f"p{i}_{j}" + ("" if key in required else "?"))
        rules.append(f'fn{i}: {json.dumps(opener)} {" ".join(params)} "</function>"')
        names.append(f"fn{i}")
    calls = 'call ("\\n" call)*' if parallel else "call"
    start = "start: TEXT? calls?\n" + _FREE_TEXT if free_text else "start: calls\n"
    return (f"{start}calls: {calls}\n"
            f'call: <tool_call> "\\n" ({" | ".join(names)}) "\\n" </tool_call>\n' + "\n".join(rules) + "\n")


def _xml_value(rule: str, prop) -> tuple[str, str]:
    """(the value's rule, what closes the parameter after it): a string runs up to the closing
    tag, which its stop consumes; anything else is JSON, then the tag."""
    prop = prop if isinstance(prop, dict) else {}
    kinds = prop.get("type", "string")
    if "string" in (kinds if isinstance(kinds, list) else [kinds]):
        return f'{rule}[stop="\\n</parameter>"]: /(.|\\n)*/', '"\\n"'
    schema = json.dumps({**prop, "x-guidance": {**COMPACT, "lenient": True}}, separators=(",", ":"))
    return f"{rule}: %json {schema}", '"\\n</parameter>\\n"'


def after_open_thought(grammar: str, close_token: str = "</think>") -> str:
    """``grammar`` (whose rule is ``start``) after a thought the prompt already opened: free text
    up to the ``</think>`` token, then the blank line Qwen3 writes, then the grammar; the
    constraint thus does not cut reasoning models short. ``close_token`` must be a special token."""
    assert grammar.startswith("start:"), grammar[:40]
    return (f'start: /(.|\\n)*/ {close_token} "\\n\\n" answer\n'
            + "answer:" + grammar[len("start:"):])


def optional_thought(grammar: str, open_token: str = "<think>", close_token: str = "</think>") -> str:
    """``grammar`` after an optional thought the model opens itself (``<think>`` free text
    ``</think>``, the blank line): reasoning models that think unprompted are not cut short, and
    the reasoning parser hands the thought on as reasoning. Both tokens must be special tokens."""
    assert grammar.startswith("start:"), grammar[:40]
    return (f'start: thought? answer\nthought: {open_token} /(.|\\n)*/ {close_token} "\\n\\n"\n'
            + "answer:" + grammar[len("start:"):])


def version() -> str:
    return getattr(_llg(), "__version__", "?")


class Grammars:
    """Per model: the llguidance tokenizer (built once, on first use or by build_in_background;
    thread-safe) and matchers."""

    def __init__(self, tokenizer_json: str, n_vocab: int, stop_ids):
        self._json, self.n_vocab, self.stop_ids = tokenizer_json, int(n_vocab), sorted(stop_ids)
        self._tok = None
        self._failed: str | None = None      # why the tokenizer could not be built: not retried
        self._lock = threading.Lock()
        self._builder: threading.Thread | None = None

    @property
    def words(self) -> int:
        """int32 words in one mask row: ceil(n_vocab / 32)."""
        return (self.n_vocab + 31) // 32

    def tokenizer(self):
        with self._lock:
            if self._tok is None and self._failed is None:
                llg = _llg()
                try:
                    self._tok = llg.LLTokenizer(self._json, n_vocab=self.n_vocab, eos_token=self.stop_ids[0]
                                                if len(self.stop_ids) == 1 else self.stop_ids)
                except Exception as e:  # noqa: BLE001 - llguidance's own error types vary
                    self._failed = f"constrained decoding is off: llguidance cannot read this tokenizer: {e}"
            if self._failed is not None:
                raise GrammarUnavailable(self._failed)
            return self._tok

    def build_in_background(self, log) -> None:
        """Start building the tokenizer on a daemon thread; it logs one line, on or off, with the
        time taken. LLTokenizer holds the GIL while it builds (about 1 s on a 152k vocabulary),
        so a build that overlaps serving stalls every stream: start it early in start-up and
        join() it before serving."""
        def build():
            t0 = time.perf_counter()
            try:
                self.tokenizer()
            except GrammarUnavailable as e:
                log.warning("%s", e)
                return
            log.info("constrained decoding: on (llguidance %s, tokenizer of %d ids built in %.2f s)",
                     version(), self.n_vocab, time.perf_counter() - t0)
        self._builder = threading.Thread(target=build, name="freetoken-grammar", daemon=True)
        self._builder.start()

    def join(self) -> None:
        """Wait for build_in_background's thread, if one was started."""
        if self._builder is not None:
            self._builder.join()
            self._builder = None

    # remembered per text: agents send the same tools every turn (Claude Code's 24 took about 5 ms
    # to check on the Xeon VM, 2026-12-04); a Grammars lives as long as its engine
    @functools.lru_cache(maxsize=64)
    def problem(self, grammar: str) -> str | None:
        """Why ``grammar`` does not compile here, or None."""
        is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        return "; ".join(messages) if is_error else None

    def matcher(self, grammar: str) -> "Matcher":
        """A fresh matcher for Lark text; GrammarError when it does not compile."""
        llg = _llg()
        m = llg.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar: {m.get_error()}")
        return Matcher(m, self.words)


class Matcher:
    """One request's grammar state."""

    def __init__(self, m, words: int):
        self._m, self.words = m, words

    def fill(self, row) -> None:
        """Write the allowed-token bitmask into ``row`` (int32[words], C-contiguous numpy)."""
        assert row.shape == (self.words,) and row.flags.c_contiguous and row.dtype.itemsize == 4
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        """Advance by the sampled token; False when the grammar rejects it (should not happen
        with its own mask applied)."""
        return bool(self._m.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        """The grammar is finished: nothing but the end may follow (or it consumed the end)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None
