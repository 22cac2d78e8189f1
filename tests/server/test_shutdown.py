"""Shutdown and start-up: the drain (open requests finish, or end with 503 / an error event at
--shutdown-timeout; /health answers 503 "draining" meanwhile, new requests 503; exit 0 either way,
a WARN line counting the ended ones), real signals, start-up failures in one line, and ``ctl``
writing into a closed pipe."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fake_core import FakeCore
from server_helpers import MODEL, ServerProcess, ServerThread

from freetoken.server.run import EXIT_DRAINED, EXIT_FAILED

LONG = "SLEEP:50 REPEAT:200"        # ~10 s: outlives any deadline below
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_request(url: str, path: str, body: dict, stream: bool, results: dict, key: str):
    """Send one request in a thread; results[key] gets (status, body text, seconds at its end)."""
    started = threading.Event()

    def run():
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + path, json={**body, "stream": stream}) as r:
                text = ""
                for chunk in r.iter_text():
                    text += chunk
                    started.set()
                results[key] = (r.status_code, text, time.monotonic())
        started.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started


def wait_running(server: ServerThread, n: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/v1/cache/status").json()["requests"]["in_flight"] < n:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.02)


def stop_in_background(server: ServerThread):
    stopper = threading.Thread(target=server.stop)
    t0 = time.monotonic()
    stopper.start()
    return stopper, t0


def test_open_requests_are_ended_at_the_deadline_in_their_api_shape(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), shutdown_timeout=0.6).start()
    results = {}
    threads = [start_request(server.url, "/v1/chat/completions", CHAT, True, results, "openai stream"),
               start_request(server.url, "/v1/messages", {**CHAT, "max_tokens": 500}, True, results,
                             "anthropic stream"),
               start_request(server.url, "/v1/chat/completions", CHAT, False, results, "non-stream")]
    for _, started in threads[:2]:
        assert started.wait(30)
    wait_running(server, 3)
    stopper, t0 = stop_in_background(server)
    time.sleep(0.2)
    health = httpx.get(server.url + "/health", timeout=5)            # still answering, as 503
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    late = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=5)
    assert late.status_code == 503 and late.json()["error"]["type"] == "unavailable_error", late.text
    stopper.join(30)
    for thread, _ in threads:
        thread.join(30)
    assert server.exit_code == EXIT_DRAINED                          # asked to stop, and stopped
    with pytest.raises(httpx.ConnectError):                          # after the drain: not accepting
        httpx.get(server.url + "/health", timeout=5)
    for key, (status, text, ended) in results.items():
        assert 0.5 < ended - t0 < 5, (key, ended - t0)      # given the time, then ended promptly
    status, text, _ = results["openai stream"]
    last = text.strip().split("\n\n")[-1]
    assert status == 200 and "[DONE]" not in text
    assert json.loads(last.removeprefix("data: "))["error"]["type"] == "unavailable_error", last
    status, text, _ = results["anthropic stream"]
    last = text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error" and json.loads(last[1][6:])["error"]["type"] == "overloaded_error", last
    status, text, _ = results["non-stream"]
    assert status == 503 and json.loads(text)["error"]["type"] == "unavailable_error", text


def test_requests_that_finish_in_time_are_not_cut(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer), shutdown_timeout=20).start()
    results = {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "SLEEP:50 REPEAT:12"}]}
    threads = [start_request(server.url, "/v1/chat/completions", body, True, results, "stream"),
               start_request(server.url, "/v1/messages", {**body, "max_tokens": 50}, False, results, "json")]
    wait_running(server, 2)
    stopper, t0 = stop_in_background(server)
    stopper.join(30)
    assert time.monotonic() - t0 < 10                  # it did not wait out the whole timeout
    assert server.exit_code == EXIT_DRAINED
    status, text, _ = results["stream"]
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]
    status, text, _ = results["json"]
    assert status == 200 and json.loads(text)["content"][0]["text"] == "tok " * 12, text


def test_sigterm_on_the_real_server_cuts_a_long_stream_and_exits_0():
    """systemd and Docker read any code but 0 after a SIGTERM as a failure: the drain that had to
    end a stream still exits 0, with a WARN line."""
    server = ServerProcess("--shutdown-timeout", "0.5")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900,
                "ignore_eos": True, "stream": True}
        results = {}
        thread, started = start_request(server.url, "/v1/chat/completions", body, True, results, "s")
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == EXIT_DRAINED, "".join(server.stderr_lines[-20:])
        assert any("were ended" in line for line in server.stderr_lines), server.stderr_lines[-20:]
        thread.join(30)
        assert '"unavailable_error"' in results["s"][1].strip().split("\n\n")[-1]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_sigint_with_nothing_open_exits_0():
    server = ServerProcess()
    server.proc.send_signal(signal.SIGINT)
    try:
        assert server.proc.wait(30) == EXIT_DRAINED, "".join(server.stderr_lines[-20:])
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken", "serve", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if " ERROR " in line]


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_serve("--port", str(port))
    assert proc.returncode == EXIT_FAILED
    [line] = error_lines(proc)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line


MODEL_CASES = {   # --model as given (tmp/ is a scratch directory) -> what the one line must say
    "Qwen/Qwen3-30B-A3B": ("looks like a Hugging Face Hub id", "does not download models",
                           "hf download Qwen/Qwen3-30B-A3B --local-dir ~/models/Qwen3-30B-A3B"),
    "tmp/model.safetensors": ("is a safetensors weights file, part of a model: pass its directory",),
    "tmp/notes.txt": ("is a file FreeToken cannot load", "a .gguf file"),
    "tmp/missing": ("does not exist", "Hugging Face model directory"),
}


@pytest.mark.parametrize("case", ["template syntax", "model without config.json", *MODEL_CASES])
def test_start_up_failures_are_one_line(tmp_path, case):
    """Each says what is wrong and what to pass instead: a hub id is not downloaded, a file is not
    a model directory (an unknown --model said "model directory ... does not exist" for all)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hi\n")
    if case == "template syntax":
        (tmp_path / "t.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
        proc, expected = run_serve("--port", "0", "--chat-template", str(tmp_path / "t.jinja")), ("line 2",)
    elif case in MODEL_CASES:
        proc = run_serve("--port", "0", "--model", case.replace("tmp/", f"{tmp_path}/"))
        expected = MODEL_CASES[case]
    else:
        proc, expected = run_serve("--port", "0", "--model", str(tmp_path)), ("no config.json",)
    assert proc.returncode == EXIT_FAILED
    [line] = error_lines(proc)
    assert all(part in line for part in expected), line


def test_ctl_into_a_closed_pipe_exits_quietly(fake_server):
    proc = subprocess.Popen([sys.executable, "-m", "freetoken", "ctl", "--url", fake_server.url, "cache", "status"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    proc.stdout.close()                    # `| head` that has already gone
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "", err
