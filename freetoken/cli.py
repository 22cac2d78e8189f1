"""Command line: ``python -m freetoken <subcommand>`` (each in commands/; engine flags from flags.py)."""
from __future__ import annotations

import argparse
import os
import sys

from freetoken.flags import ENV_PREFIX

def build_parser() -> argparse.ArgumentParser:
    from freetoken import __version__
    from freetoken.commands import register_all
    parser = argparse.ArgumentParser(
        prog="python -m freetoken",
        description="FreeToken: MoE LLM serving for one machine whose GPU cannot hold all the experts.")
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    parser.add_argument("--log-level", default=os.environ.get(ENV_PREFIX + "LOG_LEVEL", "INFO"), type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity, any case (default: INFO)")
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
