"""AsyncEngine: an EngineCore driven by its own thread; asyncio code submits, streams and aborts.

The engine thread builds the core (so loading never blocks the event loop), owns the device and
every Request, and sleeps on its command queue when idle. The event loop only sees frozen Outputs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from freetoken.engine.request import EngineBusy, InvalidRequest, Request, SamplingParams
from freetoken.log import logger


class EngineNotReady(RuntimeError):
    """The engine is still loading, failed to load, or is shutting down."""


@dataclass(frozen=True)
class Output:
    """What one engine step produced for one request (text after stop-string handling)."""

    rid: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None     # stop | length | abort | error
    stop_sequence: str | None = None     # the stop string that ended generation, if any
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0               # prompt tokens reused from the prefix cache
    error: str | None = None             # set with finish_reason "error"
    invalid: bool = False                # the error is the request's fault (a 4xx)
    logprobs: tuple = ()                 # TokenLogprob per token id, when the request asked for them
    prompt_logprobs: tuple | None = None  # on the first output of a request that asked: one per prompt token


def _logprob_fields(req: Request, d) -> dict:
    """The logprob parts of a delta's Output: its tokens', and the prompt's on the first one."""
    fields = {"logprobs": tuple(d.logprobs)} if d.logprobs else {}
    if req.params.prompt_logprobs is not None and len(req.output_ids) == len(d.token_ids):
        fields["prompt_logprobs"] = tuple(req.prompt_logprobs)
    return fields


class RequestStream:
    """The Outputs of one request, delivered on the event loop; see AsyncEngine.submit."""

    def __init__(self, engine: "AsyncEngine", rid: str, prompt_tokens: int):
        self.rid, self.prompt_tokens = rid, prompt_tokens
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[Output] = asyncio.Queue()

    async def next(self, timeout: float | None = None) -> Output | None:
        """The next Output, or None when `timeout` seconds pass without one."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result instead of
        # raising when a cancel lands just as an output arrives, and a disconnected client's
        # request would then run to its end.
        try:
            async with asyncio.timeout(timeout):
                out = await self._queue.get()
        except TimeoutError:
            return None
        self.finished = self.finished or out.finished
        return out

    def abort(self) -> None:
        """Stop generating and free the request's KV slots; safe to call at any time."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.rid)


@dataclass
class _Submit:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    rid: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]       # run on the engine thread with the core, between steps
    future: asyncio.Future


class _Stop:
    pass


class AsyncEngine:
    """Owns an engine core in a dedicated thread. ``make_core()`` is called on that thread."""

    def __init__(self, make_core: Callable[[], Any]):
        self._make_core = make_core
        self.state = "loading"          # loading | ready | failed | stopped
        self.error: str | None = None
        self.core = None                # set once ready; only the engine thread may drive it
        self.load_seconds = 0.0
        self.counters = {"steps": 0, "step_errors": 0, "decode_tokens": 0, "decode_seconds": 0.0,
                         "prefill_seconds": 0.0}
        self.decode_tok_s = 0.0         # recent decode throughput (exponential average)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[Request | None, RequestStream]] = {}   # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # --- event-loop side -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="freetoken-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (not on the event loop) until loading ends; True when ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    @property
    def tokenizer(self):
        self.require_ready()
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int | None:
        """The context length, once loaded."""
        return self.core.max_model_len if self.state == "ready" else None

    @property
    def kv_tokens(self) -> int | None:
        """Tokens the KV pool holds, once loaded: prompt plus output of one request must fit it."""
        return self.core.kv.num_slots if self.state == "ready" else None

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise InvalidRequest (with the token counts) for a prompt that can never run."""
        self.require_ready()
        self.core.scheduler.check(Request(prompt_ids=prompt_ids, params=SamplingParams()))

    def submit(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> RequestStream:
        """Queue a request; its Outputs arrive on the returned stream, the last one finished."""
        self.require_ready()
        stream = RequestStream(self, rid, len(prompt_ids))
        self._commands.put(_Submit(stream, list(prompt_ids), params))
        return stream

    def abort(self, rid: str) -> None:
        self._commands.put(_Abort(rid))

    async def call(self, fn: Callable[[Any], Any], timeout: float | None = None):
        """Run ``fn(core)`` on the engine thread between two steps and return its result."""
        self.require_ready()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        async with asyncio.timeout(timeout):        # cancel-safe on 3.11, unlike wait_for (see next())
            return await future

    async def rebuild_cache(self, **sizes) -> dict:
        """Resize the expert cache / KV pool at a safe point; EngineBusy while requests exist."""
        def rebuild(core):
            if self._live or core.has_work():
                raise EngineBusy(f"{len(self._live)} request(s) in flight; retry when idle")
            if not hasattr(core, "rebuild_cache"):
                raise NotImplementedError("this engine cannot resize its caches")
            return core.rebuild_cache(**sizes)
        return await self.call(rebuild)

    async def status(self, timeout: float = 10.0) -> dict:
        """KV and request occupancy, read on the engine thread (consistent between steps)."""
        return await self.call(self._status, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request, stop the thread and wait for it; later submits get EngineNotReady."""
        if self.state != "failed":
            self.state = "stopped"
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    def require_ready(self) -> None:
        if self.state != "ready":
            raise EngineNotReady({"loading": "the model is still loading",
                                  "failed": f"the engine failed to start: {self.error}",
                                  "stopped": "the server is shutting down"}[self.state])

    # --- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.core = self._make_core()
        except BaseException as e:  # noqa: BLE001 - reported through /health, never raised
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            # a bad model directory or option says all in its message (the server prints it in one
            # line); anything else is a bug, worth its traceback
            expected = isinstance(e, (ValueError, OSError))
            logger.log(logging.DEBUG if expected else logging.ERROR, "engine failed to load", exc_info=True)
            self._ready.set()
            return
        self.load_seconds = time.perf_counter() - t0
        if self.state == "loading":
            self.state = "ready"
        self._ready.set()
        while True:
            for cmd in self._take(block=not self.core.has_work()):
                if isinstance(cmd, _Stop):
                    self._abort_all()
                    self.core.close()
                    return
                self._handle(cmd)
            if self.core.has_work():
                self._step()

    def _take(self, block: bool) -> list:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Submit):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            req, stream = self._live.pop(cmd.rid, (None, None))
            if stream is not None:
                self.core.abort(req)
                self._post(stream, self._final(req, "abort"))
        elif isinstance(cmd, _Call):
            try:
                result, error = cmd.fn(self.core), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            self._resolve(cmd.future, result, error)

    def _add(self, cmd: _Submit) -> None:
        rid = cmd.stream.rid
        try:
            req = self.core.add_request(cmd.prompt_ids, cmd.params, rid=rid)
        except InvalidRequest as e:
            self._post(cmd.stream, Output(rid, "", (), True, "error", error=str(e), invalid=True,
                                          prompt_tokens=len(cmd.prompt_ids)))
            return
        except Exception as e:  # noqa: BLE001 - a bug: fail this request (a 500), keep serving the rest
            logger.exception("adding request %s failed", rid)
            self._discard(rid)
            self._post(cmd.stream, Output(rid, "", (), True, "error", error=f"engine error: {type(e).__name__}: {e}",
                                          prompt_tokens=len(cmd.prompt_ids)))
            return
        self._live[rid] = (req, cmd.stream)

    def _discard(self, rid: str) -> None:
        """Drop a request add_request queued before it failed: nobody reads it, and a request
        without its text stream would fail every step it ran in."""
        sched = self.core.scheduler
        for req in [r for r in (*sched.waiting, *sched.running) if r.rid == rid]:
            self.core.abort(req)

    def _step(self) -> None:
        sched = self.core.scheduler
        prefill = bool(sched.waiting) or any(r.in_prefill for r in sched.running)
        t0 = time.perf_counter()
        try:
            deltas = self.core.step()
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            self.counters["step_errors"] += 1
            affected = list(sched.running) or list(sched.waiting)   # never retry a failing step forever
            logger.exception("engine step failed; failing %d request(s)", len(affected))
            for req in affected:
                _, stream = self._live.pop(req.rid, (None, None))
                try:
                    self.core.abort(req)
                except Exception:  # noqa: BLE001 - the request is gone either way
                    logger.exception("abort after a failed step")
                if stream is not None:
                    self._post(stream, self._final(req, "error", error=f"engine error: {e}"))
            return
        self._account(prefill, len(deltas), time.perf_counter() - t0)
        for d in deltas:
            req = d.request
            _, stream = self._live.get(req.rid, (None, None))
            if stream is None:
                continue
            if d.finished:
                del self._live[req.rid]
                out = self._final(req, req.finish_reason or "stop", d.text, d.token_ids)
            else:
                out = Output(req.rid, d.text, tuple(d.token_ids), False, prompt_tokens=len(req.prompt_ids),
                             completion_tokens=len(req.output_ids), cached_tokens=req.num_cached)
            self._post(stream, replace(out, **_logprob_fields(req, d)))

    def _account(self, prefill: bool, tokens: int, seconds: float) -> None:
        c = self.counters
        c["steps"] += 1
        if prefill:
            c["prefill_seconds"] += seconds
            return
        c["decode_tokens"] += tokens
        c["decode_seconds"] += seconds
        if tokens and seconds > 0:
            rate = tokens / seconds
            self.decode_tok_s = rate if self.decode_tok_s == 0 else 0.9 * self.decode_tok_s + 0.1 * rate

    def _final(self, req: Request, reason: str, text: str = "", token_ids=(), error=None) -> Output:
        return Output(req.rid, text, tuple(token_ids), True, reason, self._stop_sequence(req, reason),
                      len(req.prompt_ids), len(req.output_ids), req.num_cached, error)

    def _stop_sequence(self, req: Request, reason: str) -> str | None:
        """Which stop string ended the request (None for end-of-sequence tokens)."""
        return req.stopped_by if reason == "stop" else None

    def _status(self, core) -> dict:
        kv, sched = core.kv, core.scheduler
        prefix = getattr(sched, "cache", None)          # the radix prefix cache, when enabled
        status = {"kv_slots": kv.num_slots, "kv_free": kv.num_free,
                  "kv_prefix_cached": prefix.size if prefix is not None else 0,
                  "running": len(sched.running), "waiting": len(sched.waiting), "in_flight": len(self._live)}
        geometry = getattr(core, "cache_status", None)   # the core's own account of its caches
        status["geometry"] = geometry() if geometry is not None else {}
        idle = not self._live and not core.has_work()
        status["idle"] = idle
        status["kv_leaked"] = (status["kv_slots"] - status["kv_free"] - status["kv_prefix_cached"]
                               if idle else 0)
        moe = getattr(core, "moe", None)
        status["moe"] = moe.stats() if moe is not None and hasattr(moe, "stats") else {}
        pool = getattr(core, "checkpoints", None)
        status["checkpoints"] = pool.status() if pool is not None else {}
        return status

    def _abort_all(self) -> None:
        for rid, (req, stream) in list(self._live.items()):
            self.core.abort(req)
            self._post(stream, self._final(req, "abort"))
        self._live.clear()

    def _post(self, stream: RequestStream, out: Output) -> None:
        try:
            self._loop.call_soon_threadsafe(stream._queue.put_nowait, out)
        except RuntimeError:        # the event loop is closed: nobody is listening any more
            pass

    def _resolve(self, future: asyncio.Future, result, error) -> None:
        def settle():
            if future.done():       # the caller timed out or was cancelled
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass
