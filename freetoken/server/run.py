"""Run the server: bind first (so /health answers 503 while the model loads), load in the engine
thread, print one ready line. On SIGINT/SIGTERM drain: new requests get 503 and /health says
"draining" while open requests get up to --shutdown-timeout to finish, the rest are ended in their
API's shape, then the server stops accepting and exits 0 (a second signal exits at once, 130).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
import threading

from freetoken.config import EngineConfig
from freetoken.engine.async_engine import AsyncEngine
from freetoken.log import logger, stamp
from freetoken.server.config import ServerConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# a drain that had to end requests still exits 0: the shutdown was asked for and done (systemd and
# Docker read any other code as a failed service); the WARN line says how many were ended
EXIT_DRAINED, EXIT_FAILED = 0, 1
CLOSE_GRACE = 2.0        # seconds after the drain's deadline for the ended requests' last bytes


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until interrupted; returns the process exit code."""
    from freetoken.models.loader import model_path
    model_dir = model_path(engine_config.model, logger)
    engine_config = engine_config.replace(model=str(model_dir))

    def make_core():
        from freetoken.engine.core import EngineCore
        return EngineCore(engine_config)
    return asyncio.run(serve_engine(AsyncEngine(make_core), model_dir, server_config))


def hypercorn_config(config: ServerConfig):
    from hypercorn.config import Config
    hc = Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.accesslog = None                        # server/access.py writes the access log
    http_log = logging.getLogger("freetoken.http")
    http_log.setLevel(logging.WARNING)         # hypercorn's own "Running on" line is replaced by ours
    hc.errorlog = http_log
    # hypercorn cancels what is left after this; the drain (access.drain) ends requests first
    hc.graceful_timeout = config.shutdown_timeout + CLOSE_GRACE
    hc.include_server_header = False
    return hc


async def serve_engine(engine: AsyncEngine, model_dir, config: ServerConfig,
                       stop: asyncio.Event | None = None, on_bound=None) -> int:
    """Serve `engine` (not yet started) until `stop` is set or a signal arrives; the exit code is
    EXIT_DRAINED, or EXIT_FAILED when the engine did not load."""
    from freetoken.server.state import ServerState
    from freetoken.tokenizer import load_chat_template

    template = load_chat_template(config.chat_template) if config.chat_template else None
    state = ServerState(engine, config, model_dir, chat_template=template)
    hc = hypercorn_config(config)
    sockets = _bind(hc, config)
    host, port = sockets.insecure_sockets[0].getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    if on_bound is not None:
        on_bound(url)
    if config.host not in LOOPBACK_HOSTS and not config.api_keys:
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use it", url)
    stop = stop or asyncio.Event()
    _install_signals(stop)
    loop = asyncio.get_running_loop()
    engine.start(loop)
    exit_code = [EXIT_DRAINED]
    threading.Thread(target=_announce, args=(engine, state, url, loop, stop, exit_code), daemon=True).start()
    try:
        cut = await _serve(state, hc, sockets, stop)
    finally:
        await asyncio.to_thread(engine.shutdown)
    if cut:
        logger.warning("shutdown: %d request(s) did not finish within %g s and were ended",
                       cut, config.shutdown_timeout)
    return exit_code[0]


async def _serve(state, hc, sockets, stop: asyncio.Event) -> int:
    """Hypercorn until `stop`, then the drain (still accepting: /health answers 503 "draining"
    and new requests 503), then hypercorn stops; returns how many requests the drain ended."""
    from hypercorn.asyncio.run import worker_serve
    from hypercorn.utils import wrap_app

    from freetoken.server import access
    from freetoken.server.app import build_app
    timeout = state.config.shutdown_timeout
    cut: list[int] = []

    async def shutdown_trigger():
        await stop.wait()
        state.stopping = True                  # from here on new requests get 503
        n = len(state.open_requests)
        logger.info("shutting down%s", f": {n} open request(s) get up to {timeout:g} s to finish" if n else "")
        cut.append(await access.drain(state, timeout))
        # returning makes hypercorn stop accepting and wait for the open connections
    await worker_serve(wrap_app(build_app(state), hc.wsgi_max_body_size, "asgi"), hc,
                       sockets=sockets, shutdown_trigger=shutdown_trigger)
    return cut[0] if cut else 0


def _bind(hc, config: ServerConfig):
    """The listening sockets, or one RuntimeError line saying why there are none."""
    try:
        sockets = hc.create_sockets()
        for sock in sockets.insecure_sockets:
            # listen now: hypercorn only does when it starts serving, after the engine was started,
            # and until then a client that saw the ready line would be refused
            sock.listen(hc.backlog)
        return sockets
    except OSError as e:
        hint = (" (is another server running there? --port picks another, 0 any free one)"
                if e.errno == errno.EADDRINUSE else "")
        raise RuntimeError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}{hint}") from None


def _announce(engine: AsyncEngine, state, url: str, loop, stop: asyncio.Event, exit_code: list) -> None:
    """Engine-load watcher: the ready line, or an error and a shutdown when loading failed."""
    if engine.wait_ready():
        print(f"{stamp()} [freetoken] ready: {url} (model {state.model!r}, loaded in {engine.load_seconds:.1f} s)",
              file=sys.stdout, flush=True)
        return
    if engine.state == "failed":
        logger.error("could not start the engine: %s", engine.error)
        exit_code[0] = EXIT_FAILED
        loop.call_soon_threadsafe(stop.set)


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum):
        if stop.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(130)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):   # not the main thread / not Unix
            pass
