"""``python -m freetoken launch``: with a stand-in harness program (a script that records the
environment and arguments it was started with, and can call the server itself), launch reuses a
running server or starts one and stops it afterwards, sets what each harness needs, forwards the
exit code and Ctrl-C, and says how to install a harness that is missing. The real harnesses:
tests/server/test_live_harness.py (slow)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import MODEL, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
FAKE = """#!{python}
import json, os, signal, sys, urllib.request
record = {{"argv": sys.argv[1:], "env": dict(os.environ),
          "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN}}
base = os.environ.get("ANTHROPIC_BASE_URL") or os.environ.get("OPENAI_API_BASE", "").removesuffix("/v1")
for arg in sys.argv[1:]:
    if "base_url=" in arg:
        base = arg.split('base_url="')[1].split('"')[0].removesuffix("/v1")
if os.environ.get("OPENCODE_CONFIG"):
    record["opencode"] = json.load(open(os.environ["OPENCODE_CONFIG"]))
    base = record["opencode"]["provider"]["freetoken"]["options"]["baseURL"].removesuffix("/v1")
if base:
    record["health"] = json.load(urllib.request.urlopen(base + "/health"))["status"]
json.dump(record, open(os.environ["FAKE_RECORD"], "w"))
if "sleep" in sys.argv:
    import signal, time
    signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
    open(os.environ["FAKE_RECORD"] + ".ready", "w").close()
    time.sleep(60)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


@pytest.fixture()
def fake(tmp_path):
    program = tmp_path / "harness"
    program.write_text(FAKE.format(python=sys.executable))
    program.chmod(0o755)
    return program, tmp_path / "record.json"


def launch(*args, env=None, **kw):
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "freetoken", "launch", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess()
    yield proc
    proc.stop()


@pytest.mark.parametrize("name", ["claude", "codex", "opencode", "aider"])
def test_each_harness_is_pointed_at_a_running_server(server, fake, name):
    program, record = fake
    done = launch(name, "--server", server.url, "--bin", str(program), "--", "-p", "hello there",
                  env={"FAKE_RECORD": str(record), "FAKE_EXIT": "3"})
    assert done.returncode == 3, done.stderr                  # the harness's exit code is launch's
    seen = json.loads(record.read_text())
    assert seen["health"] == "ok" and seen["argv"][-2:] == ["-p", "hello there"]
    assert not seen["sigint_ignored"]        # an ignored SIGINT would survive exec: no Ctrl-C in the harness
    assert f"launch: {name} -> {server.url} (model {MODEL}, context 2048" in done.stderr
    env, argv = seen["env"], " ".join(seen["argv"])
    if name == "claude":
        assert env["ANTHROPIC_MODEL"] == MODEL and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512"
        assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    elif name == "codex":
        assert f'model="{MODEL}"' in argv and "model_context_window=2048" in argv and env["FREETOKEN_API_KEY"]
    elif name == "opencode":
        provider = seen["opencode"]["provider"]["freetoken"]
        assert seen["opencode"]["model"] == f"freetoken/{MODEL}"
        assert provider["models"][MODEL]["limit"] == {"context": 2048, "output": 512}
    else:
        assert f"openai/{MODEL}" in argv and env["OPENAI_API_BASE"] == server.url + "/v1"
    assert not Path(env.get("OPENCODE_CONFIG", "/nonexistent")).exists()     # its own files are removed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_it_starts_a_server_when_none_answers_and_stops_it(fake):
    program, record = fake
    port = free_port()
    done = launch("claude", "--port", str(port), "--bin", str(program), "--max-model-len", "1024",
                  env={"FAKE_RECORD": str(record)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(record.read_text())
    assert seen["health"] == "ok" and seen["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert "context 1024" in done.stderr and "stopped the server it started" in done.stderr
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_ctrl_c_reaches_the_harness_and_the_server_is_stopped(fake):
    program, record = fake
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "freetoken", "launch", "codex", "--port", str(port),
                             "--bin", str(program), "--", "sleep"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FAKE_RECORD": str(record)}, start_new_session=True)
    ready = Path(str(record) + ".ready")
    deadline = time.monotonic() + 300
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "harness never started"
    os.killpg(proc.pid, signal.SIGINT)                         # what Ctrl-C in the terminal does
    assert proc.wait(60) == 130
    assert "stopped the server it started" in proc.stderr.read()


def test_a_missing_harness_says_how_to_install_it():
    done = launch("opencode", env={"PATH": str(Path(sys.executable).parent)})    # python, but no opencode
    assert done.returncode == 127
    assert "opencode is not installed" in done.stderr and "npm install -g opencode-ai" in done.stderr


def test_no_server_at_an_explicit_url_is_one_line():
    done = launch("aider", "--server", f"http://127.0.0.1:{free_port()}", "--bin", sys.executable)
    assert done.returncode == 1 and "no FreeToken server answers at" in done.stderr


def test_a_dry_run_names_a_built_in_model_as_its_server_would():
    """--model demo-oss with no server: the harness is pointed at the packaged name, tiny-agent-oss."""
    done = launch("codex", "--dry-run", "--model", "demo-oss", "--port", str(free_port()))
    assert done.returncode == 0 and "(model tiny-agent-oss," in done.stderr, done.stderr
    assert 'model="tiny-agent-oss"' in done.stdout, done.stdout
