"""AsyncEngine with the scripted core: failures, aborts, shutdown, idling (engine/async_engine.py)."""
import asyncio
import contextlib
import logging
import time

import httpx
import pytest
from fake_core import FakeCore
from server_helpers import MODEL, ServerThread, wait_idle

from freetoken.engine.async_engine import AsyncEngine, EngineNotReady, Output, RequestStream
from freetoken.engine.request import SamplingParams


def chat_body(text, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def run(coro):
    return asyncio.run(coro)


async def drain(stream):
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(await stream.next(10))
    return outs


@pytest.mark.parametrize("turns", range(6))
def test_a_cancel_that_lands_as_an_output_arrives_still_cancels(turns):
    """A client that disconnects just as a token arrives: the read must end cancelled (on Python
    3.11 asyncio.wait_for would return the output and the request would run to its end)."""
    async def race():
        stream = RequestStream(None, "r", 1)
        reader = asyncio.ensure_future(stream.next(30))
        await asyncio.sleep(0)                    # the reader now waits on the queue
        stream._queue.put_nowait(Output("r", "x", (1,), False))
        for _ in range(turns):                    # each count stops the reader at a different point
            await asyncio.sleep(0)
        if not reader.cancel():
            return "finished first"
        with pytest.raises(asyncio.CancelledError):
            await reader
        return "cancelled"
    assert run(race()) in ("finished first", "cancelled")


def test_submit_stream_and_idle(demo_tokenizer):
    async def main():
        engine = AsyncEngine(lambda: FakeCore(demo_tokenizer))
        with pytest.raises(EngineNotReady):
            engine.submit([1], SamplingParams(), "r0")
        engine.start()
        assert await asyncio.to_thread(engine.wait_ready, 10)
        outs = await drain(engine.submit(demo_tokenizer.encode("SAY:abc"), SamplingParams(), "r1"))
        assert "".join(o.text for o in outs) == "abc" and outs[-1].finish_reason == "stop"
        assert outs[-1].completion_tokens == len(outs)
        steps = engine.counters["steps"]
        await asyncio.sleep(0.3)                      # idle: the thread sleeps on its queue
        assert engine.counters["steps"] == steps
        status = await engine.status()
        assert status["idle"] and status["kv_leaked"] == 0
        engine.shutdown()
        assert engine.state == "stopped" and engine.core.closed
    run(main())


def test_invalid_request_becomes_an_error_output(demo_tokenizer):
    async def main():
        engine = AsyncEngine(lambda: FakeCore(demo_tokenizer, max_model_len=64))
        engine.start()
        await asyncio.to_thread(engine.wait_ready, 10)
        (out,) = await drain(engine.submit(list(range(3, 100)), SamplingParams(), "big"))
        assert out.finish_reason == "error" and out.invalid and "context length is 64" in out.error
        engine.shutdown()
    run(main())


def test_abort_of_waiting_and_running_requests_frees_slots(demo_tokenizer):
    async def main():
        engine = AsyncEngine(lambda: FakeCore(demo_tokenizer, max_running=1))
        engine.start()
        await asyncio.to_thread(engine.wait_ready, 10)
        ids = demo_tokenizer.encode("REPEAT:500 SLEEP:5")
        running = engine.submit(ids, SamplingParams(max_tokens=600), "a")
        waiting = engine.submit(ids, SamplingParams(max_tokens=600), "b")
        await running.next(10)
        waiting.abort()
        running.abort()
        running.abort()                                   # twice is fine
        status = await engine.status()
        assert status["idle"] and status["kv_free"] == status["kv_slots"]
        engine.shutdown()
    run(main())


def test_failed_step_fails_its_requests_and_keeps_serving(fake_server):
    r = httpx.post(fake_server.url + "/v1/chat/completions", json=chat_body("FAIL"), timeout=30)
    assert r.status_code == 500 and "scripted failure" in r.json()["error"]["message"]
    body = chat_body("FAIL", stream=True)
    with httpx.stream("POST", fake_server.url + "/v1/chat/completions", json=body, timeout=30) as s:
        lines = [line for line in s.iter_lines() if line]
    assert '"error"' in lines[-1] and "scripted failure" in lines[-1]
    with httpx.stream("POST", fake_server.url + "/v1/messages", json={**body, "max_tokens": 5}, timeout=30) as s:
        text = s.read().decode()
    assert "event: error" in text and "api_error" in text
    r = httpx.post(fake_server.url + "/v1/chat/completions", json=chat_body("SAY:still here"))
    assert r.json()["choices"][0]["message"]["content"] == "still here"
    status = wait_idle(fake_server.url)
    assert status["kv"]["leaked"] == 0


@contextlib.contextmanager
def error_records():
    """ERROR records of the freetoken logger (whatever handlers other tests left on it)."""
    records, log = [], logging.getLogger("freetoken")

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    handler = Keep(logging.ERROR)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize("where", ["Request", "TextStream"])      # before and after the request is queued
def test_a_bug_in_add_request_is_a_500_and_the_engine_keeps_serving(fake_server, monkeypatch, where):
    import anthropic
    import openai

    from freetoken.engine import core
    oa = openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    an = anthropic.Anthropic(base_url=fake_server.url, api_key="unused", max_retries=0, timeout=30)
    other = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "REPEAT:30 SLEEP:10"}],
                                       stream=True)
    chunks = iter(other)
    first = ""
    while not first:                    # the role chunk comes before the request is submitted
        first = next(chunks).choices[0].delta.content                 # running while the bug strikes

    def broken(*args, **kwargs):
        raise RuntimeError("injected bug")
    monkeypatch.setattr(core, where, broken)
    with error_records() as records:
        with pytest.raises(openai.InternalServerError) as e:
            oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "SAY:x"}])
        err = e.value.response.json()["error"]
        assert err["type"] == "server_error" and err["message"] == "engine error: RuntimeError: injected bug", err
        with pytest.raises(anthropic.InternalServerError) as e:
            an.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "SAY:x"}])
        assert e.value.response.json()["error"]["type"] == "api_error"
    assert len(records) == 2, [r.getMessage() for r in records]
    assert all(r.exc_info and "adding request" in r.getMessage() for r in records)
    monkeypatch.undo()
    rest = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert first + rest == "tok " * 30
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "SAY:still here"}])
    assert r.choices[0].message.content == "still here"
    status = wait_idle(fake_server.url)
    assert status["kv"]["leaked"] == 0 and status["requests"]["waiting"] == 0


def test_shutdown_ends_open_streams(demo_tokenizer):
    # the stream outlives --shutdown-timeout, so the drain ends it (test_shutdown.py has the rest)
    server = ServerThread(lambda: FakeCore(demo_tokenizer), shutdown_timeout=1).start()
    body = chat_body("REPEAT:5000 SLEEP:5", stream=True)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as s:
        lines = s.iter_lines()
        next(lines)
        t0 = time.monotonic()
        server.loop.call_soon_threadsafe(server.stop_event.set)
        rest = [line for line in lines if line]
    assert time.monotonic() - t0 < 5
    assert "shutting down" in rest[-1]
    server.stop()
    assert server.engine.state == "stopped"
