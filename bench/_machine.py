"""What a benchmark's JSON says about the machine and the code it ran: CPU model (/proc/cpuinfo),
cores, memory, date, versions and this checkout's commit. The one place bench/ reads /proc/cpuinfo:
bench/compare_llamacpp.py records machine(); agent_edits, checkpoint_cost, decode_constrained,
decode_cpu, decode_sampling, grammar_mask and policy_decisions take the model string from
cpu_info(). Imports only the stdlib at load time (grammar_mask runs in a venv without freetoken).
freetoken/commands/bench.py keeps its own reader: the package cannot import bench/."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# what picks the kernels' instruction paths (kernels/_isa.py): the vector width, the int8 and bf16
# dot products, the AMX tiles
SIMD_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    """CPU model name and flags of interest from /proc/cpuinfo (platform.processor() elsewhere)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():   # the first CPU's lines win
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name") or platform.processor() or "?",
            "family/model/stepping": "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping")),
            "simd": [f for f in SIMD_FLAGS if f in flags]}


def git_commit(root: Path = ROOT) -> str:
    """HEAD of the checkout, '+dirty' when the working tree differs from it, '?' without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def machine() -> dict:
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    from freetoken import __version__
    return {"cpu": cpu_info(), "cores": os.cpu_count(), "memory_bytes": mem,
            "kernel": platform.release(), "python": platform.python_version(),
            "freetoken": __version__, "freetoken_commit": git_commit(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def spread(values) -> str:
    """"median [min-max]" of a list of rates, one decimal: a table cell of the kernel benchmarks."""
    values = sorted(values)
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return f"{median:.1f} [{values[0]:.1f}-{values[-1]:.1f}]"


def write_results(out, rows: list) -> None:
    """{"machine": machine(), "rows": rows} as JSON at out (its folder made), said on stdout."""
    import json
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    print(f"# wrote {out}")
