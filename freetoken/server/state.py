"""What every route shares: the engine, the config, served names, defaults; body reading."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freetoken.engine.async_engine import AsyncEngine, EngineNotReady
from freetoken.server.budget import TokenLimit
from freetoken.server.config import ServerConfig
from freetoken.server.errors import APIError
from freetoken.server.metrics import Metrics
from freetoken.server.protocol import Limits


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_dir: Path
    names: tuple[str, ...] = ()                 # served model ids; names[0] is the primary
    metrics: Metrics = field(default_factory=Metrics)
    started: float = field(default_factory=time.time)
    last_rebuild: dict | None = None
    chat_template: str | None = None            # --chat-template's text, put in the tokenizer once loaded
    stopping: bool = False                      # shutdown began: new requests get 503
    open_requests: dict = field(default_factory=dict)   # asyncio.Task -> access.Record, for the drain
    _defaults: dict | None = None
    _template_installed: bool = False

    def __post_init__(self):
        if not self.names:
            given = [n.strip() for n in (self.config.served_model_name or "").split(",") if n.strip()]
            self.names = tuple(given) or (self.model_dir.name,)

    @property
    def model(self) -> str:
        return self.names[0]

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.names)}", param="model",
                           code="model_not_found")

    def ready_engine(self) -> AsyncEngine:
        """The engine, or a 503 while it loads (or after it failed)."""
        try:
            self.engine.require_ready()
        except EngineNotReady as e:
            raise APIError(503, str(e)) from None
        if self.chat_template is not None and not self._template_installed:
            # every route that renders a prompt passes here first, so none sees the checkpoint's template
            self.engine.tokenizer.set_chat_template(self.chat_template)
            self._template_installed = True
        return self.engine

    @property
    def context_length(self) -> int | None:
        """The most prompt + output tokens one request can hold, as server/budget.py enforces it:
        the context length or the KV pool, whichever is smaller (a pool resize changes it); None
        while loading."""
        if self.engine.max_model_len is None:
            return None
        return TokenLimit.of(self.engine).tokens

    def limits(self, default_max_tokens: int | None = None) -> Limits:
        """Sampling defaults: the model's generation_config.json, then the APIs' documented ones."""
        if self._defaults is None:
            self._defaults = _generation_defaults(self.model_dir)
        max_tokens = default_max_tokens or self.config.default_max_tokens or self.context_length or 2048
        return Limits(max_tokens=max_tokens, **self._defaults)

    def parse_tools(self) -> bool:
        return self.config.tool_call_parser != "none"

    def parse_reasoning(self) -> bool:
        mode = self.config.reasoning_parser
        if mode == "auto":
            tokenizer = self.ready_engine().tokenizer
            return tokenizer.token_to_id("</think>") is not None or tokenizer.speaks_harmony
        return mode == "think"


def _generation_defaults(model_dir: Path) -> dict:
    from freetoken.models.gguf_file import is_gguf
    if is_gguf(model_dir):
        gen = _gguf_sampling(model_dir)
    else:
        path = model_dir / "generation_config.json"
        try:
            gen = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            gen = {}
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float)):
        if isinstance(gen.get(key), (int, float)) and not isinstance(gen.get(key), bool):
            out[key] = kind(gen[key])
    return out


def _gguf_sampling(path: Path) -> dict:
    """A GGUF file's `general.sampling.*` keys (llama.cpp's converter writes them from the
    checkpoint's generation_config.json) under generation_config.json's names."""
    from freetoken.models.gguf_file import GGUFError, open_gguf
    try:
        metadata = open_gguf(path).metadata
    except (GGUFError, OSError):          # the server is up with the model loaded: a file changed since
        return {}
    names = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
    # float32 values read back as the decimal they were written from (0.7, not 0.699999988)
    return {ours: int(v) if key == "top_k" else float(str(np.float32(v)))
            for key, ours in names.items() if (v := metadata.get(f"general.sampling.{key}")) is not None}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)
