"""Servers for tests: a scripted-core server in a background thread (fast), and the real
``python -m freetoken serve`` process (end to end)."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import httpx

from freetoken.models.demo import packaged_demo_dir
from freetoken.engine.async_engine import AsyncEngine
from freetoken.server.config import ServerConfig

MODEL = "tiny-agent-moe"


class ServerThread:
    """serve_engine() on 127.0.0.1:<random>, in a thread with its own event loop."""

    def __init__(self, make_core, **config):
        self.engine = AsyncEngine(make_core)
        self.config = ServerConfig(port=0, **config)
        self.url = None
        self.exit_code = None               # serve_engine's, once stopped
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self):
        from freetoken.server.run import serve_engine

        async def main():
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            self.exit_code = await serve_engine(self.engine, packaged_demo_dir(), self.config, self.stop_event,
                                                self._on_bound)
        asyncio.run(main())

    def _on_bound(self, url):
        self.url = url
        self._bound.set()

    def start(self, wait_ready=True) -> "ServerThread":
        self._thread.start()
        assert self._bound.wait(30), "server did not bind"
        if wait_ready:
            assert self.engine.wait_ready(30), self.engine.error
        return self

    def stop(self):
        try:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        except RuntimeError:        # it stopped by itself (a failed load does) and closed its loop
            pass
        self._thread.join(30)
        assert not self._thread.is_alive()

    @property
    def core(self):
        return self.engine.core


def cache_status(url: str, headers=None) -> dict:
    r = httpx.get(url + "/v1/cache/status", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, headers=None, timeout=30.0) -> dict:
    """The cache status once no request is in flight (aborts are processed asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        status = cache_status(url, headers)
        if status["idle"] or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


class ServerProcess:
    """``python -m freetoken serve`` on a random loopback port; stdout gives the ready line."""

    def __init__(self, *args: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "freetoken", "serve", "--port", "0", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=full_env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                         os.path.abspath(__file__)))))
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.url = self._wait_ready(timeout=300)

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            m = re.search(r"ready: (http://\S+)", line)
            if m:
                return m.group(1)
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(self.stderr_lines[-40:]))

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


async def _stream_chat(client, messages, max_tokens: int, abort_after: int | None):
    """Stream one chat; returns (text, finish_reason), or None when it aborted on purpose."""
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
    text, finish, chunks = "", None, 0
    async for chunk in stream:
        chunks += 1
        if abort_after is not None and chunks > abort_after:
            await stream.close()                 # drop the connection mid-stream
            return None
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def check_concurrent_streams(url: str, prompts: list[list[dict]], max_tokens: int, aborting: set[int]):
    """Every prompt alone, then all at once with some clients dropping out midway: each finished
    answer must equal its solo run (greedy), and no KV slot may stay taken afterwards."""
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        solo = [await _stream_chat(client, p, max_tokens, None) for p in prompts]
        together = await asyncio.gather(*(_stream_chat(client, p, max_tokens, 2 if i in aborting else None)
                                          for i, p in enumerate(prompts)))
        await client.close()
        return solo, together
    solo, together = asyncio.run(main())
    for i, (alone, both) in enumerate(zip(solo, together)):
        if i in aborting:
            assert both is None
        else:
            assert both == alone, (i, alone, both)
    status = wait_idle(url, timeout=60)
    assert status["idle"] and status["kv"]["leaked"] == 0, status
    return solo
