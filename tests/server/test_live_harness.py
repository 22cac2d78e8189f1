"""The real Claude Code against `python -m freetoken serve` (slow: run with --slow).

Installs ``@anthropic-ai/claude-code`` with npm (cached under ~/.cache/freetoken-harness, or
$FREETOKEN_HARNESS_CACHE; delete it to take a newer version) and runs
``claude -p "say hi" --output-format json`` as tests/server/fixtures/harnesses/capture.sh runs it:
a throwaway HOME, telemetry off, every proxy variable on a dead loopback port so that nothing but
the server is reached. Claude Code sends its whole first turn (about 28k tokens of system prompt
and tools, `max_tokens` 32000) and must finish it with a success result. Skipped without npm, or
when the registry cannot be reached and nothing is cached.

The server runs the demo model so that the answer always ends (Claude Code reports a turn cut by
`max_tokens` as an error, exit 1): greedy (a copy of the model with `do_sample: false`, as Claude
Code sends no temperature) and with SAY_TEMPLATE, which renders only the user's own words.
Rendered whole, the 28k tokens are far past the 2048 positions the model was trained on and it
never stops; and the date Claude Code puts in each turn changes the greedy answer, which did not
end within 1024 tokens on 6 of 40 dates tried. The server shortens Claude Code's `max_tokens`
32000 to what the prompt leaves (docs/api.md). A second test runs `serve` as it comes (the
built-in model and its own 2048-token context) with a file question.
"""
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from server_helpers import MODEL, ServerProcess

from freetoken.models.demo import packaged_demo_dir

pytestmark = pytest.mark.slow

PACKAGE = "@anthropic-ai/claude-code"
DEAD_PROXY = "http://127.0.0.1:9"
CONTEXT = "8192"
SAY_TEMPLATE = """{%- set user = messages | selectattr("role", "equalto", "user") | list | last -%}
<|im_start|>user
{{ user.content.split("</system-reminder>") | last | trim }}<|im_end|>
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _cache_dir(tmp_path_factory) -> Path:
    """~/.cache/freetoken-harness when it can be written, else a directory of this session."""
    cache = Path(os.environ.get("FREETOKEN_HARNESS_CACHE", "~/.cache/freetoken-harness")).expanduser()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        return cache
    except OSError:
        return tmp_path_factory.mktemp("harness")


def npm_harness(tmp_path_factory, package: str, program: str) -> Path:
    """The harness `program` from npm `package`, installed once into the harness cache."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    prefix = _cache_dir(tmp_path_factory)
    binary = prefix / "node_modules" / ".bin" / program
    if binary.exists():
        return binary
    if subprocess.run([npm, "ping"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the npm registry cannot be reached")
    install = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0 and binary.exists(), install.stderr[-3000:]
    return binary


@pytest.fixture(scope="module")
def claude(tmp_path_factory) -> Path:
    return npm_harness(tmp_path_factory, PACKAGE, "claude")


def harness_env(url: str, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    proxies = {k: DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                       "all_proxy")}
    return {**env, **proxies, "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy", "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1"}


def greedy_demo_server(tmp_path: Path) -> ServerProcess:
    model = packaged_demo_dir()                  # named MODEL; greedy by its generation_config.json
    assert model.name == MODEL and json.loads((model / "generation_config.json").read_text())["do_sample"] is False
    (tmp_path / "say.jinja").write_text(SAY_TEMPLATE)
    return ServerProcess("--model", str(model), "--chat-template", str(tmp_path / "say.jinja"),
                         "--max-model-len", CONTEXT)


def test_claude_code_says_hi(claude, tmp_path):
    version = subprocess.run([str(claude), "--version"], capture_output=True, text=True, timeout=120,
                             env=harness_env("http://127.0.0.1:9", tmp_path)).stdout.strip()
    server = greedy_demo_server(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text('print("hello")\n')
    try:
        t0 = time.monotonic()
        run = subprocess.run([str(claude), "-p", "say hi", "--output-format", "json", "--model", MODEL],
                             cwd=work, env=harness_env(server.url, tmp_path), capture_output=True, text=True,
                             timeout=900)
        seconds = time.monotonic() - t0
    finally:
        code = server.stop()
    log = "".join(server.stderr_lines)
    assert run.returncode == 0, (version, run.stdout[-2000:], run.stderr[-3000:], log[-3000:])
    result = json.loads(run.stdout)
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert re.search(r'"POST /v1/messages[^"]*" 200 ', log), log[-3000:]     # it really talked to this server
    print(f"claude {version}: {seconds:.1f} s, {result.get('num_turns')} turn(s)")


def test_claude_code_pointed_straight_at_serve(claude, tmp_path):
    """`python -m freetoken serve` as it comes (the built-in model, its 2048-token context) and
    Claude Code with nothing but ANTHROPIC_BASE_URL: it asks max_tokens 32000, which the server
    shortens to what its prompt leaves (a 400 made it print "Prompt is too long" and exit 1)."""
    server = ServerProcess()
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("alpha beta gamma\n")
    try:
        run = subprocess.run([str(claude), "-p", "Read the file notes.txt and tell me the first word",
                              "--output-format", "json", "--model", MODEL], cwd=work,
                             env=harness_env(server.url, tmp_path), capture_output=True, text=True, timeout=900)
    finally:
        code = server.stop()
    log = "".join(server.stderr_lines)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:], log[-3000:])
    assert json.loads(run.stdout)["subtype"] == "success"
    assert re.search(r"max_tokens 32000 shortened to \d+: the \d+-token prompt", log), log[-3000:]
    assert code == 0 and "Traceback" not in log, log[-3000:]
