"""The command line as a user runs it: python -m freetoken ... in a subprocess."""
import re
import subprocess
import sys

import numpy as np

from freetoken.cli import build_parser

PROMPT = "import os\nimport sys\n\n\ndef "


def freetoken(*args, timeout=300):
    r = subprocess.run([sys.executable, "-m", "freetoken", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_help_lists_every_subcommand():
    out = freetoken("--help").stdout
    for cmd in ("generate", "chat", "serve", "ctl", "demo-model", "kernel", "bench"):
        assert cmd in out


def test_generate_streams_text_and_a_summary_line():
    r = freetoken("generate", "--prompt", PROMPT, "--max-tokens", "12")
    assert "(" in r.stdout                                      # the demo model writes code
    summary = [l for l in r.stderr.splitlines() if "prompt tokens" in l]
    assert summary and re.search(r"prompt tokens \d+ \| generated tokens \d+ \| prefill [\d.]+ tok/s "
                                 r"\| decode [\d.]+ tok/s", summary[-1])
    assert "built-in demo model" in r.stderr                    # the automatic choice is logged


def test_hybrid_prints_the_fused_text_and_counters_that_add_up(tmp_path):
    trace = tmp_path / "routing.npz"
    fused = freetoken("generate", "--prompt", PROMPT, "--max-tokens", "16", "--moe-backend", "fused")
    hybrid = freetoken("generate", "--prompt", PROMPT, "--max-tokens", "16", "--moe-backend", "hybrid",
                       "--moe-cache-rate", "0.25", "--stats", "--record-routing", str(trace))
    assert hybrid.stdout == fused.stdout
    line = next(l for l in hybrid.stderr.splitlines() if "MoE hits" in l)
    n = {k: int(v) for k, v in re.findall(r"(hits|misses|fills|cpu_execs) (\d+)", line)}
    assert n["fills"] + n["cpu_execs"] == n["misses"] and n["hits"] + n["misses"] > 0
    with np.load(trace) as t:
        assert t["ids"].shape[1] == 4 and t["ids"].max() < 16


def test_demo_model_random_round_trip(tmp_path):
    freetoken("demo-model", str(tmp_path / "rand"), "--random", "--seed", "3")
    r = freetoken("generate", "--model", str(tmp_path / "rand"), "--prompt", "x", "--max-tokens", "4",
                  "--ignore-eos")
    assert "generated tokens 4" in r.stderr
    freetoken("demo-model", str(tmp_path / "demo"))
    assert (tmp_path / "demo" / "model.safetensors").stat().st_size > 1e6


def test_bad_flags_are_clear_errors():
    r = subprocess.run([sys.executable, "-m", "freetoken", "generate", "--prompt", "x",
                        "--moe-cache-size", "3", "--moe-cache-rate", "0.5", "--moe-backend", "offload"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "mutually exclusive" in r.stderr


def test_log_level_takes_any_case():
    args = build_parser().parse_args(["--log-level", "debug", "ctl", "health"])
    assert args.log_level == "DEBUG"
    r = subprocess.run([sys.executable, "-m", "freetoken", "--log-level", "loud", "--help"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "invalid choice: 'LOUD'" in r.stderr


def test_serve_help_names_every_route_and_launch_the_served_model():
    """`serve --help` once left out /v1/responses; `launch --dry-run` named a model the package no
    longer has (tiny-coder-moe)."""
    from freetoken.models.demo import DEMO_NAME
    from freetoken.server.app import ROUTES
    text = " ".join(freetoken("serve", "--help").stdout.split())
    for route in ROUTES:
        path = route.path.split("{")[0].rstrip("/")
        want = ("/v1/cache/*" if path.startswith("/v1/cache") else
                "count_tokens" if path.endswith("count_tokens") else path)
        assert want in text, (route.path, text[:600])
    r = freetoken("launch", "claude", "--dry-run", "--port", "9")    # nothing listens on port 9
    assert f"ANTHROPIC_MODEL={DEMO_NAME}" in r.stdout, r.stdout
