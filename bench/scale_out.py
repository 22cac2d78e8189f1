"""Replicas behind SMG: prefix-cache hit rate and time to first token of a replay of agent
sessions, for the gateway's `cache_aware` policy against `round_robin` (docs/scale-out.md).

    python bench/scale_out.py [--smg PATH] [--replicas 2] [--sessions 7] [--turns 4]
        [--rounds 2] [--out bench/results/scale_out.json] [-- SERVE ARGS]

Each round and policy starts fresh replicas (`python -m freetoken serve`, the demo model unless
SERVE ARGS say otherwise) and `smg launch --policy P` in front of them, then replays the same
sessions: each has its own long system prompt (an agent's instructions and tool list) and
`--turns` user turns, each turn sent once the previous answer came, the sessions interleaved
turn by turn as concurrent agents' requests arrive. Per request: time to first token (streamed)
and the prompt share the replica's prefix cache served (`cached_tokens`). Policies alternate
within a round, so drift on a shared machine falls on both. A session count that the replicas
divide keeps round robin sending each session to one replica by chance: the default is odd.
Prints a table (medians and ranges over rounds) and writes JSON. `--smg` defaults to `smg` on PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import ROOT, machine  # noqa: E402

POLICIES = ("cache_aware", "round_robin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.5)


def start(smg: str, policy: str, replicas: int, serve_args: list[str]) -> tuple[str, list[subprocess.Popen]]:
    procs, urls = [], []
    for _ in range(replicas):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "freetoken", "serve", "--port", str(port), *serve_args],
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    for url, proc in zip(urls, procs):
        wait_up(url + "/health", proc, "a replica")
    port = free_port()
    procs.append(subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
                                   "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", policy,
                                   "--worker-urls", *urls], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    gateway = f"http://127.0.0.1:{port}"
    wait_up(gateway + "/v1/models", procs[-1], "smg")
    return gateway, procs


def sessions(count: int) -> list[list[dict]]:
    rules = " ".join(f"Rule {k}: keep answers short and name the file you read." for k in range(12))
    return [[{"role": "system", "content": f"You are coding agent number {i}. {rules} Tools: Read, Write, Bash."}]
            for i in range(count)]


def one_request(client: httpx.Client, gateway: str, model: str, messages: list[dict]) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices") or [])
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "text": text or "ok",
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached}


def replay(gateway: str, count: int, turns: int) -> list[dict]:
    model = httpx.get(gateway + "/v1/models", timeout=10).json()["data"][0]["id"]
    convs, out = sessions(count), []
    with httpx.Client() as client:
        for turn in range(turns):
            for i, messages in enumerate(convs):
                messages.append({"role": "user", "content": f"Turn {turn}: what does file{i}_{turn}.txt say?"})
                rec = one_request(client, gateway, model, messages)
                messages.append({"role": "assistant", "content": rec.pop("text")})
                out.append({"session": i, "turn": turn, **rec})
    return out


def summary(records: list[dict]) -> dict:
    later = [r for r in records if r["turn"] > 0]           # a first turn has nothing to reuse
    hit = sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later))
    return {"later_turn_hit_rate": hit, "ttft_median_s": statistics.median(r["ttft_s"] for r in later),
            "ttft_p90_s": sorted(r["ttft_s"] for r in later)[int(0.9 * (len(later) - 1))]}


def run(args, serve_args: list[str]) -> dict:
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rnd in range(args.rounds):
        order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
        for policy in order:
            gateway, procs = start(args.smg, policy, args.replicas, serve_args)
            try:
                records = replay(gateway, args.sessions, args.turns)
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(30)
            results[policy].append({"round": rnd, **summary(records), "requests": records})
            print(f"round {rnd} {policy}: {results[policy][-1]['later_turn_hit_rate']:.3f} hit rate, "
                  f"ttft median {results[policy][-1]['ttft_median_s'] * 1e3:.0f} ms", flush=True)
    return results


def table(results: dict) -> None:
    print(f"\n{'policy':<12} {'later-turn hit rate':>22} {'TTFT median ms':>22} {'TTFT p90 ms':>22}")
    for policy, rounds in results.items():
        def cell(key, scale=1.0, fmt="{:.3f}"):
            vals = [r[key] * scale for r in rounds]
            return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"
        print(f"{policy:<12} {cell('later_turn_hit_rate'):>22} {cell('ttft_median_s', 1e3, '{:.0f}'):>22} "
              f"{cell('ttft_p90_s', 1e3, '{:.0f}'):>22}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smg", default=shutil.which("smg") or "smg")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=7)     # odd: round robin moves every session
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale_out.json"))
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    results = run(args, serve_args)
    table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "serve_args": serve_args,
                                          "results": results}, indent=1))
    print(f"\nwrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
