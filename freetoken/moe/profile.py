"""The bandwidth profile (docs/design.md, The bandwidth profile): what `python -m freetoken bench bw` measured on this
machine, and what the start-up plan (engine/plan_moe.py) reads from it: the backend it recommends
and hybrid's phi.

File: $FREETOKEN_HOME/bench_bw.json, written atomically (temporary file + rename), keyed by GPU UUID
then expert format (bf16, f32, or a quantized format's name: the CPU kernels' B_H differs per
format), so one file serves several GPUs and formats without one overwriting another:

    {"version": 1, "profiles": {"GPU-<uuid>": {"bf16": {<entry>}}}}

entry: timestamp, host, gpu {uuid, name}, cpu {model, physical_cores, threads}, format,
expert_bytes, b_p_gbs (fill bandwidth, pinned host -> slots; null without a GPU), b_h_gbs (CPU
expert-kernel bandwidth), contended {pcie_gbs, cpu_gbs} (both at once; null when not measured),
recommended, reason, handoff_us {thread, inline}. A profile of another GPU, format or file version is ignored with a WARN line;
an unreadable file too (never a crash).

phi prefers the contended pair, pcie / (pcie + cpu) (the makespan-optimal fraction of two
branches that slow each other down), and falls back to the standalone B_P / B_H (docs/moe.md).
The backend recommendation uses the standalone numbers; the file keeps both pairs, because each
answers a different question.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from freetoken.log import Log

VERSION = 1
FILENAME = "bench_bw.json"
NO_GPU = "no-gpu"          # key of a profile measured without a GPU (B_H only)
# Hybrid is recommended only when the CPU's expert bandwidth is more than this many times the
# fill bandwidth (phi = B_P / B_H < 1/2): below that a miss is about as cheap to fetch as to run
# on the CPU, and offload keeps the cache learning. Upstream's `bench bw --threshold` default.
HYBRID_THRESHOLD = 2.0


@dataclass(frozen=True)
class Profile:
    gpu_uuid: str
    gpu_name: str
    format: str                      # expert format: "bf16" (uint16 banks), "f32", or a quantized
    #                                  one ("q4_k", "fp8_b128": `bench bw --format`, kernels/qformats.py)
    expert_bytes: int
    b_h_gbs: float
    b_p_gbs: float | None = None
    contended: dict | None = None    # {"pcie_gbs": float, "cpu_gbs": float}
    recommended: str = ""
    reason: str = ""
    timestamp: str = ""
    host: str = ""
    cpu: dict = field(default_factory=dict)
    handoff_us: dict = field(default_factory=dict)   # CPU branch cost per layer call, by mode

    def entry(self) -> dict:
        d = asdict(self)
        d["gpu"] = {"uuid": d.pop("gpu_uuid"), "name": d.pop("gpu_name")}
        return d

    @classmethod
    def from_entry(cls, d: dict) -> "Profile":
        gpu = d.get("gpu") or {}
        contended = d.get("contended")
        if contended is not None:
            contended = {"pcie_gbs": float(contended["pcie_gbs"]), "cpu_gbs": float(contended["cpu_gbs"])}
        b_p = d.get("b_p_gbs")
        return cls(gpu_uuid=str(gpu["uuid"]), gpu_name=str(gpu.get("name", "")), format=str(d["format"]),
                   expert_bytes=int(d["expert_bytes"]), b_h_gbs=float(d["b_h_gbs"]),
                   b_p_gbs=None if b_p is None else float(b_p), contended=contended,
                   recommended=str(d.get("recommended", "")), reason=str(d.get("reason", "")),
                   timestamp=str(d.get("timestamp", "")), host=str(d.get("host", "")),
                   cpu=dict(d.get("cpu") or {}), handoff_us=dict(d.get("handoff_us") or {}))


def profile_path() -> Path:
    from freetoken.env import home
    return home() / FILENAME


def _read(path: Path, log: Log) -> dict | None:
    """The file's data, or None when absent, unreadable, or of another version (WARN)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warn(f"bandwidth profile {path} is unreadable ({type(e).__name__}: {e}); ignoring it")
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("profiles"), dict):
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        log.warn(f"bandwidth profile {path} has version {found!r}, this build reads version {VERSION}; "
                 "ignoring it (rerun `python -m freetoken bench bw`)")
        return None
    return data


def save_profile(profile: Profile, path: str | Path | None = None, log=None) -> Path:
    """Add or replace this GPU's entry for this format; other entries are kept. Atomic."""
    path = Path(path) if path else profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path, Log(log)) or {"version": VERSION, "profiles": {}}
    data["profiles"].setdefault(profile.gpu_uuid, {})[profile.format] = profile.entry()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)            # readers see the old file or the new one, never half
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def load_profile(gpu_uuid: str, fmt: str, path: str | Path | None = None, log=None) -> Profile | None:
    """This GPU's profile for expert format fmt, or None (WARN when the file is of no use here)."""
    log = Log(log)
    path = Path(path) if path else profile_path()
    data = _read(path, log)
    if data is None:
        return None
    profiles = data["profiles"]
    if gpu_uuid not in profiles:
        others = ", ".join(sorted(profiles)) or "none"
        log.warn(f"bandwidth profile {path} was measured on other GPUs ({others}), not {gpu_uuid}; "
                 "ignoring it (run `python -m freetoken bench bw` on this machine)")
        return None
    if fmt not in profiles[gpu_uuid]:
        log.warn(f"bandwidth profile {path} has no {fmt!r} entry for {gpu_uuid} (has "
                 f"{', '.join(sorted(profiles[gpu_uuid]))}); ignoring it")
        return None
    try:
        return Profile.from_entry(profiles[gpu_uuid][fmt])
    except (KeyError, TypeError, ValueError) as e:
        log.warn(f"bandwidth profile {path}: the {gpu_uuid}/{fmt} entry is malformed ({e!r}); ignoring it")
        return None


def phi(profile: Profile | None) -> float | None:
    """Fetch fraction: contended pcie / (pcie + cpu), else B_P / B_H, else None."""
    if profile is None:
        return None
    c = profile.contended
    if c and c.get("pcie_gbs", 0) > 0 and c.get("cpu_gbs", 0) > 0:
        return c["pcie_gbs"] / (c["pcie_gbs"] + c["cpu_gbs"])
    if profile.b_p_gbs and profile.b_p_gbs > 0 and profile.b_h_gbs > 0:
        return profile.b_p_gbs / profile.b_h_gbs
    return None


def recommend(profile: Profile | None, fits: bool) -> tuple[str, str]:
    """(backend, reason with the numbers): fused if every expert fits in GPU memory; hybrid iff
    B_H > HYBRID_THRESHOLD x B_P; else offload (also without a usable profile)."""
    if fits:
        return "fused", "every expert fits in GPU memory"
    if profile is None:
        return "offload", ("the experts do not fit in GPU memory and there is no bandwidth profile "
                           "for this GPU and format (run `python -m freetoken bench bw`)")
    b_p, b_h = profile.b_p_gbs, profile.b_h_gbs
    if not b_p or b_p <= 0:
        return "offload", "the experts do not fit and the bandwidth profile has no fill bandwidth B_P"
    verb = ">" if b_h > HYBRID_THRESHOLD * b_p else "<="
    choice = "hybrid" if verb == ">" else "offload"
    return choice, (f"CPU expert bandwidth B_H {b_h:.1f} GB/s {verb} {HYBRID_THRESHOLD:g} x fill "
                    f"bandwidth B_P {b_p:.1f} GB/s (phi {phi(profile):.3f}, profile of "
                    f"{profile.timestamp or 'unknown date'})")
