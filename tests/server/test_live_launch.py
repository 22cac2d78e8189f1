"""Real round trips through `python -m freetoken launch` with the built-in model (slow: --slow).

Each harness is asked "Read the file notes.txt and tell me the first word" in fresh random
directories holding notes.txt (TRIES each) and must give the right word in 9 of 10. Claude Code
(`launch claude -- -p ...`): the model calls Read, Claude Code runs it and sends the result back,
the answer names the word. Codex CLI (`launch codex -- exec ...`): a command that prints the
file, then the answer. aider (`launch aider -- --message ... notes.txt`): no tools; the answer
from the file in the chat, in one request. Codex CLI also completes a tool round trip with the
built-in gpt-oss (`--model demo-oss`). Claude Code and Codex come from npm, aider from pip
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import agent_corpus  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ASK = "Read the file notes.txt and tell me the first word"
# Fresh random directories, as a user's: since the stage of 2026-12-04 the model passes the path
# as the user wrote it (Claude Code 2.1.197's Read resolves a relative one against its working
# directory), so the directory's name no longer has to be copied. Each harness gets TRIES runs,
# each in its own mkdtemp directory with its own first word, and must answer RIGHT_AT_LEAST.
# None of them is in the training corpus: they are tools/agent_corpus.py's HELD_OUT_WORDS, and it
# draws no note word, path or vocabulary word among them (tests/test_training_corpus.py). Until
# 2026-12-04 five were among its 40 common words, and those were the ones the model got right.
WORDS = list(agent_corpus.HELD_OUT_WORDS)
TRIES = len(WORDS)
RIGHT_AT_LEAST = 9          # of TRIES: the bar; a failure says how many were wrong
# Stage 8 of the built-in model (2026-12-07: every letters-only token and pseudo-words as note
# words, copied tokens weighted 4x; greedy by its generation_config.json) passes Claude Code's and
# Codex's tries (9 of 10 in a replay of their second requests: `window`, one token, comes back
# garbled). aider's answers run on past the word (`pencilsplit`): 7 of 10 on 2026-12-07 (it was
# 5); its copying stays strict-xfail, while the rest of its run (one request, no tool-call markup)
# is held on every try. Strict: once RIGHT_AT_LEAST pass, the marker must go.
COPYING_AIDER = pytest.mark.xfail(strict=True, reason="through aider the built-in model names 7 of 10 unseen first "
                                                        "words right (issue 26, item 1: >= 9 of 10 wanted)")


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


def launch(harness: str, binary: Path, work: Path, env: dict, *args: str,
           serve: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken", "launch", harness, "--port", str(free_port()),
                           "--bin", str(binary), *serve, "--", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=1200)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def names(word: str, answer: str) -> bool:
    """The answer gives the word as the first word ("... is castle." or "... is `castle`.")."""
    return re.search(rf"\bis\W*{word}\b", answer) is not None


def runs(tmp_path: Path, run_one) -> list[tuple[str, bool, tuple]]:
    """run_one(work, env, word) -> (right, transcript) in TRIES fresh directories, one word each."""
    out = []
    for i in range(TRIES):
        word = WORDS[i % len(WORDS)]
        work, env = scratch(tmp_path, word)
        try:
            out.append((word, *run_one(work, env, word)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def tries(tmp_path: Path, run_one) -> None:
    """RIGHT_AT_LEAST of the TRIES runs must be right (the count is printed either way)."""
    assert_right(runs(tmp_path, run_one))


def assert_right(results: list[tuple[str, bool, tuple]]) -> None:
    wrong = [(word, transcript) for word, right, transcript in results if not right]
    print(f"{TRIES - len(wrong)} of {TRIES} right; wrong: {[w for w, _ in wrong]}")
    assert TRIES - len(wrong) >= RIGHT_AT_LEAST, \
        f"{len(wrong)} of {TRIES} wrong ({', '.join(w for w, _ in wrong)}); the first:\n{wrong[0][1]}"


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


OSS_TRIES = 3


def test_codex_completes_a_tool_round_trip_with_the_gpt_oss_model(codex, tmp_path):
    """Issue 27: Codex CLI against the built-in gpt-oss (`--model demo-oss`, harmony, MXFP4 experts),
    in OSS_TRIES fresh directories: every run's model calls a tool, Codex runs the command and sends
    its output back, and the model's next message ends the turn. What the answer says is not the
    test (how many name the word is printed)."""
    named = 0
    for word in WORDS[:OSS_TRIES]:
        work, env = scratch(tmp_path, word)
        try:
            subprocess.run(["git", "init", "-q", str(work)], check=True)
            run = launch("codex", codex, work, env, "exec", "--json", "--skip-git-repo-check", ASK,
                         serve=("--model", "demo-oss"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        done = [e["item"] for e in events if e.get("type") == "item.completed"]
        ran = [i for i in done if i.get("type") == "command_execution" and i.get("exit_code") is not None]
        answers = [i for i in done[done.index(ran[0]) + 1:] if i.get("type") == "agent_message"] if ran else []
        assert run.returncode == 0 and ran and answers and answers[-1]["text"].strip(), \
            (run.stderr[-2000:], json.dumps(events, indent=1)[-4000:])
        named += names(word, answers[-1]["text"])
    print(f"the answer named the first word in {named} of {OSS_TRIES}")


@pytest.fixture(scope="module")
def aider_runs(aider, tmp_path_factory) -> list[tuple[str, tuple[bool, bool], tuple]]:
    """aider sends no tools: the file is in the chat. Per try: (word, (named it, one request with
    no tool-call markup), transcript)."""
    def run_one(work, env, word):
        subprocess.run(["git", "init", "-q", str(work)], check=True)
        run = launch("aider", aider, work, env, "--yes-always", "--no-auto-commits", "--no-gitignore",
                     "--message", ASK, "notes.txt")
        clean = run.returncode == 0 and "tool_call>" not in run.stdout and run.stdout.count("Tokens:") == 1
        return (names(word, run.stdout), clean), (run.stderr[-2000:], run.stdout[-4000:])
    return runs(tmp_path_factory.mktemp("aider"), run_one)


def test_aider_answers_once_without_markup(aider_runs):
    """Every try: one request (no reflection loop), exit 0, no tool-call markup in the answer."""
    bad = [(word, transcript) for word, (_, clean), transcript in aider_runs if not clean]
    assert not bad, f"{len(bad)} of {TRIES}: {bad[0]}"


@COPYING_AIDER
def test_aider_answers_from_the_file_it_was_given(aider_runs):
    assert_right([(word, named, transcript) for word, (named, _), transcript in aider_runs])
