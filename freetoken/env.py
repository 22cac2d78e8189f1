"""FREETOKEN_* environment switches, declared in one place and read at use, never at import; and\nthe host facts the engine sizes its defaults from."""
import os
from pathlib import Path


def home() -> Path:
    """Where FreeToken keeps generated models, profiles and caches (FREETOKEN_HOME)."""
    return Path(os.environ.get("FREETOKEN_HOME") or Path.home() / ".cache" / "freetoken")


def flag(name: str) -> bool:
    """True when FREETOKEN_<name> is set to 1/true/yes (debug switches: KERNEL_DEBUG, SYNC_LAUNCH)."""
    return os.environ.get(f"FREETOKEN_{name}", "").strip().lower() in ("1", "true", "yes", "on")


def available_memory_bytes() -> int | None:
    """The kernel's MemAvailable (memory new allocations can get without swapping), None where
    /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
