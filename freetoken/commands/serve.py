"""``serve``: the OpenAI- and Anthropic-compatible HTTP server (the built-in demo model by default)."""
from __future__ import annotations

from freetoken.flags import add_config_flags, config_from_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve OpenAI and Anthropic APIs over HTTP (default 127.0.0.1:1919)",
                       description="Serve a model over HTTP: /v1/chat/completions, /v1/completions, /v1/responses, "
                                   "/v1/models, /v1/messages (+ /count_tokens), /health, /metrics, /v1/cache/*. "
                                   "Without --model it serves the built-in demo model. See docs/api.md.")
    from freetoken.server.config import ServerConfig
    add_config_flags(p, ServerConfig)
    add_config_flags(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from freetoken.config import EngineConfig
    from freetoken.server.config import ServerConfig
    from freetoken.server.run import serve
    return serve(config_from_args(args, EngineConfig), config_from_args(args, ServerConfig))
