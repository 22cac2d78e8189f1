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


def _env_default(f: dataclasses.Field):
    """The flag's default: its FREETOKEN_* environment mirror when set, else the dataclass default."""
    raw = os.environ.get(env_name(f.name))
    if raw is None:
        return f.default
    kind = type(f.default) if f.default is not None else str
    return kind(raw) if kind is not bool else raw.lower() in ("1", "true", "yes", "on")


def add_config_flags(parser: argparse.ArgumentParser, cls=EngineConfig, skip=()) -> None:
    """One --flag per dataclass field, with its help, choices, default and env mirror shown."""
    group = parser.add_argument_group(f"{cls.__name__} options (each also read from {ENV_PREFIX}<NAME>)")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        kind = type(f.default) if f.default is not None else str
        help_text = f"{meta.get('help', '')} (default: {f.default!r}; env {env_name(f.name)})"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=_env_default(f), help=help_text)
            continue
        group.add_argument(flag, dest=f.name, type=kind, default=_env_default(f),
                           choices=meta.get("choices"), help=help_text)


def config_from_args(args: argparse.Namespace, cls=EngineConfig):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
