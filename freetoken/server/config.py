"""ServerConfig: the HTTP side of ``serve`` (bind, auth, limits, parsers). Flags come from its fields."""
from __future__ import annotations

from dataclasses import dataclass, field


def _flag(default, help_text: str, choices: tuple | None = None):
    meta = {"help": help_text}
    if choices:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and talks; the engine's own options are EngineConfig."""

    host: str = _flag("127.0.0.1", "address to bind (binding beyond loopback without --api-key logs a warning)")
    port: int = _flag(1919, "TCP port (0: any free port, printed on the ready line)")
    api_key: str | None = _flag(None, "require this key (Authorization: Bearer or x-api-key) on every "
                                      "route but /health; several keys: comma-separated")
    served_model_name: str | None = _flag(None, "model id clients send, comma-separated aliases accepted "
                                                "(None: the model directory's name)")
    max_body_bytes: int = _flag(32 << 20, "largest request body accepted (413 above)")
    sse_ping_interval: float = _flag(15.0, "seconds of silence before a keep-alive on a stream (0: none)")
    default_max_tokens: int = _flag(0, "output budget when a request gives none (0: up to the context length)")
    max_tokens_beyond_room: str = _flag("shorten", "a max_tokens the client gave that does not fit after the "
                                                   "prompt: shorten it to what is left (the answer ends with "
                                                   "finish reason length / max_tokens if it gets there, as "
                                                   "llama.cpp's server does; Claude Code asks 32000), or refuse "
                                                   "it with a 400 giving the counts, as vLLM does",
                                        ("shorten", "refuse"))
    tool_call_parser: str = _flag("auto", "how tool calls are read from the output: qwen reads "
                                          "<tool_call> JSON and <function=...> XML", ("auto", "qwen", "none"))
    tool_call_grammar: bool = _flag(True, "with tools given and tool_choice auto, a tool call the model opens "
                                          "is held to the tools' names and parameter schemas from its "
                                          "opening token on (free text before it stays free)")
    reasoning_parser: str = _flag("auto", "split <think>...</think> (gpt-oss: the analysis channel) into "
                                          "reasoning_content / thinking blocks (auto: when the vocabulary "
                                          "has </think> or harmony's markers)",
                                  ("auto", "think", "none"))
    allowed_origins: str = _flag("", "browser origins allowed besides loopback ones, comma-separated "
                                     "(requests carrying another Origin get 403); these get CORS headers")
    shutdown_timeout: float = _flag(5.0, "seconds open requests get to finish on SIGTERM/SIGINT before "
                                         "they are ended with 503 / an error event")
    access_log: bool = _flag(True, "one INFO line per request: method, path, status, tokens, time to "
                                   "first token, total time")
    chat_template: str | None = _flag(None, "a Jinja chat template file used instead of the model's own "
                                            "(checked at start-up)")

    def __post_init__(self):
        checks = [(0 <= self.port <= 65535, "port must be in [0, 65535]"),
                  (self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024"),
                  (self.sse_ping_interval >= 0, "sse_ping_interval must be >= 0"),
                  (self.default_max_tokens >= 0, "default_max_tokens must be >= 0"),
                  (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())
