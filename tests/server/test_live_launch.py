"""Real round trips through `python -m freetoken launch` with the built-in model (slow: --slow).

Each harness is asked "Read the file notes.txt and tell me the first word" in fresh random
directories holding notes.txt (TRIES each) and must give the right word in 9 of 10. Claude Code
(`launch claude -- -p ...`): the model calls Read, Claude Code runs it and sends the result back,
the answer names the word. Codex CLI (`launch codex -- exec ...`): a command that prints the
file, then the answer. aider (`launch aider -- --message ... notes.txt`): no tools; the answer
from the file in the chat, in one request. Claude Code and Codex come from npm, aider from pip
(cached as in test_live_harness.py); every proxy variable points at a dead loopback port and
HOME is throwaway, so nothing but the local server is reached.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_live_harness import DEAD_PROXY, claude, npm_harness  # noqa: F401  (claude is a fixture)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ASK = "Read the file notes.txt and tell me the first word"
# Fresh random directories, as a user's: since the stage of 2026-12-04 the model passes the path
# as the user wrote it (Claude Code 2.1.197's Read resolves a relative one against its working
# directory), so the directory's name no longer has to be copied. Each harness gets TRIES runs,
# each in its own mkdtemp directory with its own first word, and must answer RIGHT_AT_LEAST.
# None of them is in the 40 common words the training corpus draws a fifth of its note words from
# (tools/agent_corpus.py WORDS): until 2026-12-04 five were (banana, orange, river, garden, silver),
# and those were the ones the model got right.
WORDS = ["marble", "copper", "harvest", "planet", "window", "lantern", "tunnel", "rocket", "pencil", "castle"]
TRIES = len(WORDS)
RIGHT_AT_LEAST = 9          # of TRIES: the bar; a failure says how many were wrong
# Every harness ran the right call on 2026-12-04 (tiny-agent-moe, stage 6), but the model names
# the word right only where it has learned it: 8 of 10 with the old list (its five training words
# all right), and with this one 6 of 10 through Claude Code, 5 through Codex and 5 through aider.
# A seventh stage with a quarter of the note words drawn from the tokenizer's one-token words
# (1200 steps, `window` had come back as `view`) gave 6, 5 and 7: not kept. Strict: once
# RIGHT_AT_LEAST pass, the marker must go.
COPYING = pytest.mark.xfail(strict=True, reason="the built-in model copies 5-6 of 10 unseen first words right "
                                                 "(issue 26, item 1: >= 9 of 10 wanted)")


@pytest.fixture(scope="module")
def codex(tmp_path_factory) -> Path:
    return npm_harness(tmp_path_factory, "@openai/codex", "codex")


@pytest.fixture(scope="module")
def aider(tmp_path_factory) -> Path:
    """aider from pip in a venv of its own in the harness cache (FREETOKEN_HARNESS_CACHE)."""
    from test_live_harness import _cache_dir
    venv = _cache_dir(tmp_path_factory) / "aider-venv"
    if not (venv / "bin" / "aider").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aider-chat"], capture_output=True,
                                 text=True)
        if install.returncode != 0:
            pytest.skip(f"pip install aider-chat failed (no registry?): {install.stderr[-500:]}")
    return venv / "bin" / "aider"


def scratch(tmp_path: Path, word: str) -> tuple[Path, dict]:
    work, home = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(dir=tmp_path))
    (work / "notes.txt").write_text(f"{word} split recipe\nthen coffee\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_"))}
    proxies = {k: DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                       "all_proxy")}
    return work, {**env, **proxies, "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost",
                  "no_proxy": "127.0.0.1,localhost", "PYTHONPATH": str(ROOT)}


def launch(harness: str, binary: Path, work: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken", "launch", harness, "--port", str(free_port()),
                           "--bin", str(binary), "--", *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def names(word: str, answer: str) -> bool:
    """The answer gives the word as the first word ("... is castle." or "... is `castle`.")."""
    return re.search(rf"\bis\W*{word}\b", answer) is not None


def tries(tmp_path: Path, run_one) -> None:
    """run_one(work, env, word) -> (right, transcript) in TRIES fresh directories; RIGHT_AT_LEAST must be right."""
    wrong = []
    for i in range(TRIES):
        word = WORDS[i % len(WORDS)]
        work, env = scratch(tmp_path, word)
        try:
            right, transcript = run_one(work, env, word)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not right:
            wrong.append((word, transcript))
    assert TRIES - len(wrong) >= RIGHT_AT_LEAST, \
        f"{len(wrong)} of {TRIES} wrong ({', '.join(w for w, _ in wrong)}); the first:\n{wrong[0][1]}"


@COPYING
def test_claude_code_reads_a_file_through_a_tool_call(claude, tmp_path):  # noqa: F811
    def run_one(work, env, word):
        run = launch("claude", claude, work, env, "-p", ASK, "--output-format", "stream-json", "--verbose")
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        uses = [b for e in events if e.get("type") == "assistant" for b in e["message"]["content"]
                if b.get("type") == "tool_use"]
        results = [b for e in events if e.get("type") == "user" for b in (e["message"]["content"] or [])
                   if isinstance(b, dict) and b.get("type") == "tool_result"]
        final = next((e for e in events if e.get("type") == "result"), {})
        right = (run.returncode == 0 and any(u["name"] == "Read" for u in uses)
                 and any(word in json.dumps(r.get("content")) for r in results)        # Claude Code ran it
                 and final.get("subtype") == "success" and word in final.get("result", "")
                 and "tool_call>" not in final.get("result", ""))
        return right, (run.stderr[-2000:], json.dumps(events, indent=1)[-4000:])
    tries(tmp_path, run_one)


@COPYING
def test_codex_runs_a_command_through_a_tool_call(codex, tmp_path):
    def run_one(work, env, word):
        subprocess.run(["git", "init", "-q", str(work)], check=True)
        run = launch("codex", codex, work, env, "exec", "--json", "--skip-git-repo-check", ASK)
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        commands = [e for e in events if "command" in json.dumps(e) and word in json.dumps(e)]
        answers = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                   and e.get("item", {}).get("type") == "agent_message"]
        right = run.returncode == 0 and bool(commands) and any(names(word, a) for a in answers)
        return right, (run.stderr[-2000:], json.dumps(events, indent=1)[-4000:])
    tries(tmp_path, run_one)


@COPYING
def test_aider_answers_from_the_file_it_was_given(aider, tmp_path):
    """aider sends no tools: the file is in the chat; the answer must name its first word, once
    (one request: no reflection loop), with no tool-call markup."""
    def run_one(work, env, word):
        subprocess.run(["git", "init", "-q", str(work)], check=True)
        run = launch("aider", aider, work, env, "--yes-always", "--no-auto-commits", "--no-gitignore",
                     "--message", ASK, "notes.txt")
        right = run.returncode == 0 and names(word, run.stdout) and "tool_call>" not in run.stdout
        return right and run.stdout.count("Tokens:") == 1, (run.stderr[-2000:], run.stdout[-4000:])
    tries(tmp_path, run_one)
