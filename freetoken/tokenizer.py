"""Tokenizer (HF `tokenizers`), the model's Jinja chat template, stop ids, streaming detokenizer."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from freetoken.config import ConfigError

_REPLACEMENT = "\ufffd"  # what a cut UTF-8 sequence decodes to
_CONTEXT_TOKENS = 6      # prompt tokens kept as decode context (leading-space rules)
_LONG_TEXT = 32 << 10    # characters; longer texts are encoded with the GIL released (see encode)


class ChatTemplateError(ValueError):
    """The chat template failed to render (raise_exception in the template, bad messages)."""


class TooManyTokens(Exception):
    """A text has more tokens than the caller's limit; ``tokens`` is the exact count."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"{tokens} tokens, more than the limit of {limit}")
        self.tokens = tokens


class Tokenizer:
    """A model directory's tokenizer.json plus tokenizer_config.json and generation_config.json."""

    def __init__(self, tok, config: dict, eos_ids: list[int]):
        self._tok = tok                   # tokenizers.Tokenizer
        self.config = config              # tokenizer_config.json (chat template removed)
        self.chat_template = _pop_template(config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        stop = set(eos_ids)
        if self.eos_token is not None and tok.token_to_id(self.eos_token) is not None:
            stop.add(tok.token_to_id(self.eos_token))
        self.stop_token_ids: frozenset[int] = frozenset(stop)
        self._compiled: dict[str, object] = {}
        self._byte_level: bool | None = None     # decoder is byte-level BPE; read on first token_bytes
        self._added = frozenset(tok.get_added_tokens_decoder())   # ids whose piece is literal text

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer  # heavy import, at use
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ConfigError(f"{model_dir}: no tokenizer.json")
        config = _read_json(d / "tokenizer_config.json")
        if "chat_template" not in config:  # newer transformers save the template beside it
            config["chat_template"] = _template_file(d)
        gen = _read_json(d / "generation_config.json") or _read_json(d / "config.json")
        eos = gen.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(HFTokenizer.from_file(str(d / "tokenizer.json")), config, eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text (the grammar engine builds its own tokenizer from it)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def speaks_harmony(self) -> bool:
        """gpt-oss's harmony format: its message markers are tokens of this vocabulary (the server
        then parses channels, server/harmony.py, and keeps the markers in the output text)."""
        return self.token_to_id("<|channel|>") is not None and self.token_to_id("<|message|>") is not None

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Token ids; with `limit`, more than `limit` tokens raise TooManyTokens (with the count)."""
        if len(text) <= _LONG_TEXT:
            encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            # encode() holds the GIL throughout (~0.5 s per MB); encode_batch() releases it, so the
            # server's event loop keeps running while a long prompt is tokenized in a worker thread
            encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(encoding) > limit:
            # counted without building the id list: for millions of tokens that list would take
            # ~70 ns a token with the GIL held, and hundreds of MB
            raise TooManyTokens(len(encoding), limit)
        return encoding.ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character, which decode() would turn into U+FFFD); special tokens give their text."""
        if self._byte_level is None:
            decoder = json.loads(self._tok.to_str()).get("decoder") or {}
            kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
            self._byte_level = "ByteLevel" in kinds
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self._byte_level and int(token_id) not in self._added:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the prompt text (HF semantics); kwargs reach the template (enable_thinking, ...)."""
        source = self._select_template(tools)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = _environment().from_string(source)
        variables = {k: v for k, v in (("bos_token", self.bos_token),
                                       ("eos_token", self.eos_token)) if v is not None}
        variables.update(kwargs)
        from jinja2.exceptions import TemplateError
        try:
            return template.render(messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None

    def set_chat_template(self, source: str) -> None:
        """Use `source` (Jinja text, e.g. from load_chat_template) instead of the checkpoint's template."""
        self.chat_template = source
        self._compiled.clear()

    def _select_template(self, tools) -> str:
        """A string template, or HF's named list: 'tool_use' when tools are given, else 'default'."""
        t = self.chat_template
        if isinstance(t, str):
            return t
        if not t:
            raise ChatTemplateError("this tokenizer has no chat template")
        if tools is not None and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        raise ChatTemplateError(f"no 'default' among the named chat templates {sorted(t)}")

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_ids=()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens, prompt_ids)


class IncrementalDetokenizer:
    """Token ids in, one at a time; only complete new text out (never half a UTF-8 character).

    Decodes the window ids[prefix:] only: ids[prefix:read] were already emitted and stay as context
    (a decoder may treat the first token specially), ids[read:] are not yet emitted. A U+FFFD at
    the end of the window's text means a character is still cut, so it waits for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids=()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in list(prompt_ids)[-_CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is still cut)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The remainder at the end of the stream (a cut character comes out as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        done = decode(self._ids[self._prefix:self._read], self._skip)
        text = decode(self._ids[self._prefix:], self._skip)
        if text == done:  # skipped special tokens and the like: nothing to wait for
            self._read = len(self._ids)
            return ""
        if not final and (len(text) <= len(done) or text.endswith(_REPLACEMENT)):
            return ""
        # Keep the just-emitted tokens as the next window's context; forget older ones.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(done):] if text.startswith(done) else text[_common_prefix(done, text):]


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each byte, inverted (the GPT-2 table:
    printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    stand_in, extra = {}, 0
    for b in range(256):
        if b in keep:
            stand_in[chr(b)] = b
        else:
            stand_in[chr(256 + extra)] = b
            extra += 1
    return stand_in


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_chat_template(path: str | Path) -> str:
    """A chat template file's text, checked now: it must compile and render one user turn."""
    from jinja2.exceptions import TemplateSyntaxError
    p = Path(path).expanduser()
    try:
        source = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        template = _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template {p}: line {e.lineno}: {e.message}") from None
    try:
        template.render(messages=[{"role": "user", "content": "hello"}], tools=None, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - raise_exception(), or anything a Jinja expression raises
        raise ConfigError(f"--chat-template {p}: fails on a one-message conversation: "
                          f"{type(e).__name__}: {e}") from None
    return source


def _environment():
    """HF's template environment: sandboxed, trim/lstrip blocks, loopcontrols, tojson, helpers."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (HF assistant masks): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF overrides jinja's tojson: no HTML escaping, key order kept, non-ASCII kept
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _pop_template(config: dict):
    """chat_template as a string, a {name: template} dict (from HF's list form), or None."""
    t = config.pop("chat_template", None)
    if isinstance(t, list):
        return {item["name"]: item["template"] for item in t}
    return t


def _template_file(d: Path):
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    return _read_json(d / "chat_template.json").get("chat_template")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
