"""The agent harnesses ``python -m freetoken launch`` can point at a FreeToken server: for each, the
program, how to install it, and the environment, arguments and config files that make it talk to
the server only (base URL, a key, the model id, the context and output limits, telemetry and
auto-update off). Nothing in the user's own harness configuration is changed: settings travel as
environment variables, command-line overrides, or files in a directory of the launch's own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Everything but the server is off: telemetry, error reports, update checks, model lists.
QUIET = {"DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class Target:
    base_url: str            # http://host:port of the FreeToken server
    model: str               # the model id it serves
    context: int             # its context length in tokens
    api_key: str             # the server's key, or a dummy one when it needs none

    @property
    def output_tokens(self) -> int:
        """The output budget a harness asks for: a quarter of the context, which leaves the rest
        for the prompt (harnesses otherwise ask for 32k and get a 400 from a small context)."""
        return max(256, self.context // 4)


@dataclass
class Plan:
    env: dict = field(default_factory=dict)      # set for the harness
    args: list = field(default_factory=list)     # before the user's own arguments
    files: dict = field(default_factory=dict)    # path -> text, written before the harness starts

    def summary(self) -> str:
        keys = sorted(k for k in self.env if k not in QUIET)
        return ", ".join(keys + [f"{len(self.args)} arguments"] * bool(self.args) + [str(p) for p in self.files])


@dataclass(frozen=True)
class Harness:
    name: str
    program: str
    install: str
    plan: Callable[[Target, Path], Plan]      # (target, the launch's own directory) -> Plan


def claude(t: Target, home: Path) -> Plan:
    return Plan(env={"ANTHROPIC_BASE_URL": t.base_url, "ANTHROPIC_AUTH_TOKEN": t.api_key,
                     "ANTHROPIC_MODEL": t.model, "ANTHROPIC_SMALL_FAST_MODEL": t.model,
                     "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
                     "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.output_tokens),
                     "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
                     "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})


def codex(t: Target, home: Path) -> Plan:
    """Codex reads `-c key=value` overrides (TOML values) on top of its own config.toml. It has no
    output-limit setting (0.171 ignores model_max_output_tokens): the server's budget applies."""
    provider = (f'{{name="FreeToken", base_url="{t.base_url}/v1", env_key="FREETOKEN_API_KEY", '
                f'wire_api="responses"}}')
    overrides = {"model_provider": '"freetoken"', "model_providers.freetoken": provider,
                 "model": json.dumps(t.model), "model_context_window": str(t.context),
                 "check_for_update_on_startup": "false",
                 "analytics.enabled": "false", "feedback.enabled": "false", "otel.exporter": '"none"'}
    return Plan(env={"FREETOKEN_API_KEY": t.api_key},
                args=[a for k, v in overrides.items() for a in ("-c", f"{k}={v}")])


def opencode(t: Target, home: Path) -> Plan:
    config = home / "opencode.json"
    body = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "model": f"freetoken/{t.model}",
            "provider": {"freetoken": {"npm": "@ai-sdk/openai-compatible", "name": "FreeToken",
                                       "options": {"baseURL": f"{t.base_url}/v1", "apiKey": t.api_key},
                                       "models": {t.model: {"name": t.model, "limit": {
                                           "context": t.context, "output": t.output_tokens}}}}}}
    return Plan(env={"OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                     "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1",
                     "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"},
                files={config: json.dumps(body, indent=1) + "\n"})


def aider(t: Target, home: Path) -> Plan:
    meta = home / "aider-model-metadata.json"
    body = {f"openai/{t.model}": {"max_input_tokens": t.context, "max_output_tokens": t.output_tokens,
                                  "max_tokens": t.output_tokens, "input_cost_per_token": 0.0,
                                  "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}}
    return Plan(env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_BASE": f"{t.base_url}/v1",
                     "OPENAI_API_KEY": t.api_key},
                args=["--model", f"openai/{t.model}", "--model-metadata-file", str(meta), "--no-check-update",
                      "--analytics-disable", "--no-show-release-notes", "--no-show-model-warnings"],
                files={meta: json.dumps(body, indent=1) + "\n"})


HARNESSES = {h.name: h for h in (
    Harness("claude", "claude", "npm install -g @anthropic-ai/claude-code", claude),
    Harness("codex", "codex", "npm install -g @openai/codex", codex),
    Harness("opencode", "opencode", "npm install -g opencode-ai", opencode),
    Harness("aider", "aider", "pip install aider-chat", aider),
)}
