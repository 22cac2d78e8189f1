"""The table of bench/compare_llamacpp.py: medians and ranges of the per-process measurements, the
FreeToken / llama.cpp ratio of each row (which way is better depends on the row), and the ratios
round by round. A round runs the two engines back to back, so its ratio shares the box's state:
the shared VMs switch between fast and slow phases (~20% apart) from minute to minute, which
moves a ratio of medians taken across rounds, not a round's own ratio."""
from __future__ import annotations

import statistics

ENGINES = ("freetoken", "llama.cpp")
HIGHER, LOWER = "higher", "lower"       # which ratio side is FreeToken's win


def rows_for(key: str) -> list[tuple[str, str, str, float]]:
    """(metric, label, better, scale) of the rows one measure key produces."""
    kind, _, n = key.partition("@")
    if kind == "decode" and n.endswith("+hog"):
        return [("tok_s", f"decode tok/s, {int(n[:-4]):,} tokens of context, one core kept busy by "
                          "another process", HIGHER, 1.0)]
    if kind == "decode":
        return [("tok_s", f"decode tok/s, {int(n):,} tokens of context", HIGHER, 1.0)]
    if kind == "prefill":
        return [("tok_s", f"prefill tok/s, {int(n):,}-token prompt", HIGHER, 1.0)]
    if kind == "first-prefill":
        return [("tok_s", f"first prefill tok/s of a process, {int(n):,}-token prompt", HIGHER, 1.0)]
    if kind == "startup":
        return [("first_byte_s", "start to first output byte, s (warm page cache)", LOWER, 1.0),
                ("max_rss_bytes", "peak RSS of that run, GB", LOWER, 1e-9)]
    raise ValueError(f"unknown measure {key!r}")


def median_range(xs) -> dict | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize(samples: dict) -> list[dict]:
    """One row per (measure, metric): each engine's median_range and the ratio of medians."""
    rows = []
    for key, by_engine in samples.items():
        for metric, label, better, scale in rows_for(key):
            stats = {e: median_range([m[metric] * scale for m in by_engine.get(e, [])
                                      if m.get(metric) is not None]) for e in ENGINES}
            ft, lc = stats["freetoken"], stats["llama.cpp"]
            ratio = ft["median"] / lc["median"] if ft and lc and lc["median"] else None
            rows.append({"measure": key, "metric": metric, "label": label, "better": better,
                         **stats, "ratio": ratio, "round_ratios": _round_ratios(by_engine, metric)})
    return rows


def _round_ratios(by_engine: dict, metric: str) -> dict | None:
    """median_range of FreeToken / llama.cpp within each round that measured both (round i is
    entry i of each engine's list)."""
    pairs = zip(by_engine.get("freetoken", []), by_engine.get("llama.cpp", []))
    return median_range([a[metric] / b[metric] for a, b in pairs if a.get(metric) is not None and b.get(metric)])


def _cell(s: dict | None) -> str:
    if s is None:
        return "-"
    digits = 2 if s["median"] < 10 else 1
    lo, mid, hi = (f"{s[k]:.{digits}f}" for k in ("min", "median", "max"))
    return mid if lo == hi else f"{mid} [{lo}-{hi}]"


def _ratio_cell(s: dict | None) -> str:
    if s is None:
        return "-"
    lo, mid, hi = (f"{s[k]:.2f}" for k in ("min", "median", "max"))
    return mid if lo == hi else f"{mid} [{lo}-{hi}]"


def table(rows: list[dict], threads: int, rounds: int, fmt: str = "bf16") -> str:
    """Markdown table; the header says the GGUF format llama.cpp read and which side of 1 is
    FreeToken's win."""
    head = (f"| measure ({threads} threads, batch 1, greedy; median [range] of {rounds} round(s)) | "
            f"FreeToken | llama.cpp {fmt} | FreeToken / llama.cpp (tok/s: >= 1 FreeToken better; "
            "RSS, start-up: <= 1 FreeToken better) | the ratio round by round |\n|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        by_round = _ratio_cell(r.get("round_ratios"))
        lines.append(f"| {r['label']} | {_cell(r['freetoken'])} | {_cell(r['llama.cpp'])} | {ratio} | {by_round} |")
    return "\n".join(lines)


def check_line(check: dict | None) -> str:
    if check is None:
        return "greedy check: skipped (--check-tokens 0)"
    prompt = "tokenized identically" if check["prompt_ids_equal"] else "TOKENIZED DIFFERENTLY"
    verdict = "same" if check["identical_prefix"] == check["tokens"] else "DIFFERENT"
    return (f"greedy check: {verdict} tokens; the first {check['identical_prefix']} of {check['tokens']} "
            f"generated ids identical (a {len(check['prompt_ids'])}-token prompt, {prompt} by both engines)")


def brief(m: dict) -> str:
    """One run's numbers for the progress lines."""
    parts = []
    if m.get("tok_s") is not None:
        parts.append(f"{m['tok_s']:.1f} tok/s")
    if m.get("first_byte_s") is not None:
        parts.append(f"first byte {m['first_byte_s']:.2f} s")
    if m.get("max_rss_bytes"):
        parts.append(f"RSS {m['max_rss_bytes'] / 1e9:.2f} GB")
    return ", ".join(parts) or m.get("note", "")
