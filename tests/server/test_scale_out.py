"""Replicas behind a gateway (docs/scale-out.md).

Fast: the bodies SMG (the Shepherd Model Gateway, `pip install smg`, 1.13.0 on 2026-12-04)
forwards, captured through tests/server/fixtures/harnesses/capture_proxy.py, are answered 200: it
adds vLLM's `priority` 0 and sampling defaults to every Responses request. Slow: two
`python -m freetoken serve` replicas of the demo model and `smg launch --policy cache_aware` from
pip in a throwaway venv (cached beside the harnesses); agent sessions through the gateway stay
on the replica that holds their prefix, the sessions spread over both replicas, and when one
replica is killed the gateway keeps answering from the other."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, ServerProcess

# as SMG 1.13.0 forwards a Responses request that gave only input and max_output_tokens
SMG_RESPONSES = {"input": "hi", "max_output_tokens": 8, "model": MODEL, "store": True, "temperature": 1.0,
                 "priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
SMG_CHAT = {"messages": [{"role": "user", "content": "hello"}], "model": MODEL, "logprobs": False,
            "max_tokens": 4, "stream": False, "priority": 0}


def test_what_smg_forwards_is_answered(fake_server):
    assert httpx.post(fake_server.url + "/v1/responses", json=SMG_RESPONSES).status_code == 200
    assert httpx.post(fake_server.url + "/v1/chat/completions", json=SMG_CHAT).status_code == 200
    r = httpx.post(fake_server.url + "/v1/chat/completions", json={**SMG_CHAT, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "arrival order" in r.json()["error"]["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def smg_binary(tmp_path_factory) -> Path:
    """`smg` from pip in a venv of its own, kept in the harness cache (FREETOKEN_HARNESS_CACHE)."""
    from test_live_harness import _cache_dir
    venv = _cache_dir(tmp_path_factory) / "smg-venv"
    binary = venv / "bin" / "smg"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "smg"], capture_output=True, text=True)
        if install.returncode != 0:
            pytest.skip(f"pip install smg failed (no registry?): {install.stderr[-500:]}")
    return binary


@pytest.fixture(scope="module")
def gateway(smg_binary):
    replicas = [ServerProcess(), ServerProcess()]
    port = _free_port()
    proc = subprocess.Popen([str(smg_binary), "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                             "--policy", "cache_aware", "--worker-urls", *(r.url for r in replicas)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _up(url + "/v1/models"):
        assert proc.poll() is None and time.monotonic() < deadline, "smg did not start"
        time.sleep(0.5)
    yield url, replicas
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)
    for r in replicas:
        r.stop()


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _served(replicas) -> list[int]:
    """Chat requests each replica has finished (its /metrics)."""
    out = []
    for r in replicas:
        text = httpx.get(r.url + "/metrics", timeout=10).text
        out.append(sum(int(n) for n in re.findall(r'freetoken_requests_total\{route="/v1/chat/completions",[^}]*\} (\d+)', text)))
    return out


@pytest.mark.slow
def test_sessions_keep_their_replica_spread_and_fail_over(gateway):
    url, replicas = gateway
    sessions = [[{"role": "system", "content": f"You are agent {i}. " + "Keep every answer brief. " * 30}]
                for i in range(6)]
    homes: dict[int, set[int]] = {i: set() for i in range(len(sessions))}
    cached_later = []
    for turn in range(3):
        for i, messages in enumerate(sessions):
            messages.append({"role": "user", "content": f"turn {turn}: what is in file{i}.txt?"})
            before = _served(replicas)
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            after = _served(replicas)
            homes[i] |= {k for k in range(2) if after[k] > before[k]}
            if turn:
                cached_later.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                                    / r.json()["usage"]["prompt_tokens"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"})
    assert all(len(h) == 1 for h in homes.values()), homes               # each session kept its replica
    assert {next(iter(h)) for h in homes.values()} == {0, 1}, homes        # and both replicas got sessions
    assert min(cached_later) > 0.8, cached_later                           # later turns mostly cached
    replicas[1].proc.kill()
    replicas[1].proc.wait(10)
    for i in range(4):
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": sessions[i % len(sessions)][:2], "max_tokens": 4})
        assert r.status_code == 200, r.text                                # the other replica answers
