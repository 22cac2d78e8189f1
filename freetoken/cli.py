"""Command line: ``python -m freetoken <subcommand>``. Engine flags are generated from EngineConfig."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

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


def build_parser() -> argparse.ArgumentParser:
    from freetoken import __version__
    from freetoken.commands import register_all
    parser = argparse.ArgumentParser(
        prog="python -m freetoken",
        description="FreeToken: MoE LLM serving for one machine whose GPU cannot hold all the experts.")
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    parser.add_argument("--log-level", default=os.environ.get(ENV_PREFIX + "LOG_LEVEL", "INFO"),
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_all(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from freetoken import log
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []   # for the program a command runs
    args = parser.parse_args(argv[:len(argv) - len(passthrough) - 1] if "--" in argv else argv)
    if not args.command:
        parser.print_help()
        return 2
    if "--" in argv and not hasattr(args, "passthrough"):
        parser.error(f"arguments after -- are for the program `launch` runs; {args.command} takes none")
    if hasattr(args, "passthrough"):
        args.passthrough = passthrough
    log.setup(args.log_level)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        log.logger.error("%s", e)
        return 1
