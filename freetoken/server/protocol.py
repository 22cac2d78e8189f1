"""Request validation: typed, range-checked reads of JSON fields, and sampling parameters.

Every field is checked for type, sign and range before it reaches the engine; JSON null reads as
absent. Errors are APIError(400) naming the field (``param``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from freetoken.engine.request import InvalidRequest, SamplingParams
from freetoken.log import logger
from freetoken.server.errors import APIError

MISSING = object()
INT_MAX = 2**31 - 1
MAX_STOP = 16               # stop strings per request
MAX_STOP_CHARS = 1000       # characters per stop string


class Body:
    """One JSON object of a request body, read field by field."""

    def __init__(self, data, path: str = ""):
        if not isinstance(data, dict):
            raise APIError(400, f"{path or 'the request body'} must be a JSON object", param=path or None)
        self.data, self.path = data, path

    def param(self, key) -> str:
        return f"{self.path}.{key}" if self.path else str(key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _get(self, key, default):
        value = self.data.get(key)
        if value is None:
            if default is MISSING:
                raise APIError(400, f"{self.param(key)} is required", param=self.param(key))
            return MISSING
        return value

    def _bad(self, key, what: str):
        return APIError(400, f"{self.param(key)} must be {what}", param=self.param(key))

    def str(self, key, default=MISSING, *, choices=None, nonempty=False, max_len=None):
        v = self._get(key, default)
        if v is MISSING:
            return default
        if not isinstance(v, str):
            raise self._bad(key, "a string")
        if choices is not None and v not in choices:
            raise self._bad(key, "one of " + ", ".join(repr(c) for c in choices))
        if nonempty and not v:
            raise self._bad(key, "a non-empty string")
        if max_len is not None and len(v) > max_len:
            raise self._bad(key, f"at most {max_len} characters")
        return v

    def int(self, key, default=MISSING, *, lo=None, hi=INT_MAX):
        v = self._get(key, default)
        if v is MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, "an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(key, f"an integer in [{lo}, {hi}]")
        return v

    def float(self, key, default=MISSING, *, lo=None, hi=None, lo_open=False):
        v = self._get(key, default)
        if v is MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(key, "a number")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise self._bad(key, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
        return float(v)

    def bool(self, key, default=MISSING):
        v = self._get(key, default)
        if v is MISSING:
            return default
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def list(self, key, default=MISSING, *, nonempty=False, max_items=None) -> list:
        v = self._get(key, default)
        if v is MISSING:
            return default
        if not isinstance(v, list):
            raise self._bad(key, "an array")
        if nonempty and not v:
            raise self._bad(key, "a non-empty array")
        if max_items is not None and len(v) > max_items:
            raise self._bad(key, f"an array of at most {max_items} items")
        return v

    def obj(self, key, default=MISSING) -> "Body":
        v = self._get(key, default)
        if v is MISSING:
            return default
        return Body(v, self.param(key))

    def only(self, allowed) -> None:
        """Reject fields this server does not know (it cannot honour what it does not understand)."""
        for key in self.data:
            if key not in allowed:
                raise APIError(400, f"unrecognized request argument: {self.param(key)}", param=self.param(key))

    def default_only(self, key, defaults: tuple, why: str = "is not supported") -> None:
        """Accept a known field only at a value that changes nothing."""
        v = self.data.get(key)
        if v is not None and not any(_same(v, d) for d in defaults):
            raise APIError(400, f"{self.param(key)} {why}", param=self.param(key))


def _same(value, default) -> bool:
    """Equal and of the same kind (JSON true is not the number 1)."""
    return isinstance(value, bool) == isinstance(default, bool) and value == default


@dataclass(frozen=True)
class Limits:
    """What the server fills in for fields a request leaves out."""

    max_tokens: int                  # default output budget
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def stop_strings(body: Body, key: str) -> tuple[str, ...]:
    """A string or a list of strings (empty strings are dropped: they could never match)."""
    v = body.data.get(key)
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise body._bad(key, "a string or an array of strings")
    if len(items) > MAX_STOP:
        raise body._bad(key, f"at most {MAX_STOP} strings")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise body._bad(key, f"strings of at most {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(s for s in items if s))


def sampling(body: Body, limits: Limits, *, max_tokens: int | None, stop: tuple[str, ...],
             temperature_max: float) -> SamplingParams:
    """The shared sampling fields (temperature, top_p, top_k, min_p, seed, ignore_eos)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else limits.max_tokens,
            temperature=body.float("temperature", limits.temperature, lo=0.0, hi=temperature_max),
            top_p=body.float("top_p", limits.top_p, lo=0.0, hi=1.0, lo_open=True),
            top_k=body.int("top_k", limits.top_k, lo=-1),
            min_p=body.float("min_p", limits.min_p, lo=0.0, hi=1.0),
            seed=body.int("seed", None, lo=0, hi=2**63 - 1),
            stop=stop,
            ignore_eos=body.bool("ignore_eos", False))
    except InvalidRequest as e:
        raise APIError(400, str(e)) from None


def constrained(params: SamplingParams, grammar: str | None, what: str, param: str) -> SamplingParams:
    """params with the output constrained to ``grammar`` (Lark text; None: unchanged); a 400 that
    names the extra when llguidance is not installed. ``what`` names the request field."""
    if grammar is None:
        return params
    from freetoken import grammar as g
    if not g.available():
        raise APIError(400, f"{what} needs constrained decoding, which is not installed: {g.INSTALL_HINT}",
                       param=param)
    return replace(params, grammar=grammar)


def json_format_grammar(kind: str, schema: dict | None, harmony: bool = False) -> str | None:
    """The grammar of a structured-output format: text -> None, json_object -> any JSON object,
    json_schema -> a JSON value matching the schema (none given: any JSON value). harmony (gpt-oss):
    the JSON is the final message's, after an optional analysis message."""
    from freetoken.grammar import harmony_final_grammar, json_grammar
    if kind == "text":
        return None
    schema = None if kind == "json_object" else schema if schema is not None else {}
    return harmony_final_grammar(schema) if harmony else json_grammar(schema)


def speaks_harmony(state) -> bool:
    """Whether the served model writes gpt-oss's harmony format (its output is parsed, and its
    grammars are keyed to, harmony's markers)."""
    return state.ready_engine().tokenizer.speaks_harmony


def tool_choice_grammar(state, conv, parallel: bool) -> tuple[str | None, str]:
    """(grammar, field) for a conversation with tools: the model's tool-call form (Qwen3's JSON
    one, or Qwen3-Coder's XML one where the template writes it) over the tools shown (all, or the
    named one), forced for `required` or a named tool (a 400 naming the missing dependency where
    llguidance is not installed, as for json_schema), and after free text for `auto` (a triggered
    grammar: a call the model opens is well-formed; off with --no-tool-call-grammar or
    --tool-call-parser none, or where llguidance is missing). A harmony model (gpt-oss) is held to
    harmony's call form: forced, or for `auto` as one of the reply's two ends (the final message
    the other). None for no tools and `none`."""
    if not conv.tools or conv.choice == "none":
        return None, "tool_choice"
    from freetoken import grammar as g
    auto = conv.choice == "auto"
    if auto and not (state.parse_tools() and state.config.tool_call_grammar and g.available()):
        return None, "tool_choice"
    if not g.available():
        raise APIError(400, f"tool_choice {conv.choice!r} needs constrained decoding, which is not "
                            f"installed: {g.INSTALL_HINT}", param="tool_choice")
    if speaks_harmony(state):          # one call a turn in harmony: parallel does not arise
        grammar = g.harmony_tool_call_grammar(conv.template_tools, auto=auto)
        return (_auto_grammar(state, grammar) if auto else grammar), "tool_choice"
    xml = "<function=" in (state.ready_engine().tokenizer.chat_template or "")     # Qwen3-Coder's form
    form = g.xml_tool_call_grammar if xml else g.tool_call_grammar
    grammar = form(conv.template_tools, parallel=parallel, free_text=auto)
    return (_auto_grammar(state, grammar) if auto else grammar), "tool_choice"


def _auto_grammar(state, grammar: str) -> str | None:
    """tool_choice auto's grammar, or None (a WARN line) where it does not compile: nothing was
    forced, so the request runs free rather than failing."""
    from freetoken import grammar as g
    try:
        problem = state.ready_engine().core.grammars.problem(grammar)
    except g.GrammarUnavailable:          # llguidance cannot read this tokenizer: start-up said so
        return None
    if problem is not None:
        logger.warning("tool_choice auto: this request's tool calls are not held to a grammar, the "
                       "tools' schemas do not compile: %s", problem)
        return None
    return grammar


# a request's effort as gpt-oss's template takes it (low, medium, high)
HARMONY_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                  "xhigh": "high", "max": "high"}


def effort_kwargs(kwargs: dict, effort: str | None) -> dict:
    """A request's reasoning effort as template variables, unless chat_template_kwargs set them:
    none renders with enable_thinking false (Qwen3's switch); gpt-oss's template reads
    reasoning_effort (none and minimal as low, xhigh and max as high; it has no off switch)."""
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    if effort in HARMONY_EFFORT:
        kwargs.setdefault("reasoning_effort", HARMONY_EFFORT[effort])
    return kwargs


def template_kwargs(body: Body, key: str = "chat_template_kwargs") -> dict:
    """Extra chat-template variables (enable_thinking, ...); names the template owns are refused."""
    if not body.has(key):
        return {}
    kwargs = body.obj(key).data
    for name in kwargs:
        if name in ("messages", "tools", "add_generation_prompt") or not name.isidentifier():
            raise APIError(400, f"{body.param(key)}.{name} cannot be set", param=f"{body.param(key)}.{name}")
    return dict(kwargs)
