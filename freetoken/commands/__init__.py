"""Subcommands of ``python -m freetoken``; each module has ``register(subparsers)``."""
import importlib

COMMANDS = ("generate", "demo_model", "chat", "serve", "launch", "ctl", "kernel", "bench")


def register_all(sub) -> None:
    for name in COMMANDS:
        importlib.import_module(f"freetoken.commands.{name}").register(sub)
