"""Flags generated from the config dataclasses: one --flag per field, its help, choices and default
written once (config.py), each also read from a FREETOKEN_<NAME> environment variable."""
from __future__ import annotations

import argparse
import dataclasses
import os

from freetoken.config import EngineConfig

ENV_PREFIX = "FREETOKEN_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


AUTO = "auto"     # what an optional field's flag or env mirror takes to mean "decided at start-up"


def _kind(f: dataclasses.Field) -> type:
    return f.metadata.get("kind") or (type(f.default) if f.default is not None else str)


def _parser(f: dataclasses.Field):
    """The flag's value type; an optional field (default None) also takes "auto"."""
    kind = _kind(f)
    if f.default is not None or "kind" not in f.metadata:
        return kind

    def optional(raw: str):
        return None if raw.strip().lower() == AUTO else kind(raw)
    optional.__name__ = kind.__name__      # argparse names the type in its error message
    return optional


def _env_default(f: dataclasses.Field):
    """The flag's default: its FREETOKEN_* environment mirror when set, else the dataclass default."""
    raw = os.environ.get(env_name(f.name))
    if raw is None:
        return f.default
    if _kind(f) is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    return _parser(f)(raw)


def add_config_flags(parser: argparse.ArgumentParser, cls=EngineConfig, skip=()) -> None:
    """One --flag per dataclass field, with its help, choices, default and env mirror shown."""
    group = parser.add_argument_group(f"{cls.__name__} options (each also read from {ENV_PREFIX}<NAME>)")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        shown = AUTO if f.default is None and "kind" in meta else repr(f.default)
        help_text = f"{meta.get('help', '')} (default: {shown}; env {env_name(f.name)})"
        flag = "--" + f.name.replace("_", "-")
        if _kind(f) is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=_env_default(f), help=help_text)
            continue
        group.add_argument(flag, dest=f.name, type=_parser(f), default=_env_default(f),
                           choices=meta.get("choices"), help=help_text)


def config_from_args(args: argparse.Namespace, cls=EngineConfig):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
