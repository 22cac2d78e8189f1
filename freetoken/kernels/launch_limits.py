"""The table of what each entry point of cuda/*.cu needs, measured: the registers per thread
and the static shared memory per block that real ptxas reports compiling every source for
sm_80, sm_90 and sm_120 (kernels/_nvrtc.py; no GPU needed), written to cuda/launch_limits.json
for freetoken/device_limits.py (the rules a device refuses launches by) to read on machines
without NVRTC. tests/kernels/test_launch_limits.py recompiles and fails when it is stale:

    python -m freetoken.kernels.launch_limits --write

Quantized modules (-DQFMT=code, one module per format) take the most over every format.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from freetoken.device_limits import ARCHS, TABLE, cuda_dir, table

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def parse(log: str) -> dict[str, dict]:
    """ptxas -v output -> {entry: {registers, static_smem, stack, spills}} of one compile."""
    found, entry = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            found[entry] = {"registers": 0, "static_smem": 0, "stack": 0, "spills": 0}
        elif entry and (m := _FRAME.search(line)):
            found[entry].update(stack=int(m.group(1)), spills=int(m.group(2)) + int(m.group(3)))
        elif entry and (m := _USED.search(line)):
            found[entry].update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
    return found


def variants(source: str) -> list[tuple[str, ...]]:
    """The defines a source is built with: every format code for a quantized module."""
    if re.search(r"#\s*ifndef\s+QFMT", source):
        from freetoken.kernels.qformats import FORMATS
        return [(f"-DQFMT={f.code}",) for f in FORMATS]
    return [()]


def jobs(archs=ARCHS) -> list[tuple]:
    """(path, arch, defines) of every compile: each cuda/*.cu and variant, for each arch."""
    from freetoken.kernels import _cuda
    return [(path, arch, defines) for path in sorted(cuda_dir().glob("*.cu"))
            for defines in variants(_cuda.read_source(path)) for arch in archs]


def measure() -> dict[str, dict]:
    """The table, compiled now: {entry: {file, registers: {arch: n}, static_smem, stack, spills}},
    each the most over the source's variants (and, for all but registers, over the archs)."""
    from concurrent.futures import ThreadPoolExecutor
    from freetoken.kernels import _nvrtc
    todo = jobs()
    with ThreadPoolExecutor(os.cpu_count()) as pool:       # NVRTC runs outside the GIL
        logs = list(pool.map(lambda job: _nvrtc.ptxas_log(*job), todo))
    table: dict[str, dict] = {}
    for (path, arch, _), log in zip(todo, logs):
        for entry, got in parse(log).items():
            row = table.setdefault(entry, {"file": path.name, "registers": {},
                                           "static_smem": 0, "stack": 0, "spills": 0})
            if row["file"] != path.name:
                raise ValueError(f"entry {entry} is in both {row['file']} and {path.name}")
            row["registers"][arch] = max(row["registers"].get(arch, 0), got["registers"])
            for key in ("static_smem", "stack", "spills"):
                row[key] = max(row[key], got[key])
    return dict(sorted(table.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="ptxas's per-kernel registers and shared memory for "
                                 "every cuda/*.cu: write cuda/launch_limits.json or check it")
    ap.add_argument("--write", action="store_true", help="write the table (else: check it)")
    args = ap.parse_args(argv)
    fresh, path = measure(), cuda_dir() / TABLE
    if args.write:
        path.write_text(json.dumps(fresh, indent=1) + "\n")
        print(f"wrote {path}: {len(fresh)} entry points")
        return 0
    stale = table() != fresh
    print(f"{path} is {'stale: rerun with --write' if stale else 'current'}")
    return int(stale)


if __name__ == "__main__":
    sys.exit(main())
