"""Run the server: bind first (so /health answers 503 while the model loads), load in the engine
thread, print one ready line, and shut down gracefully on SIGINT/SIGTERM (a second one forces it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

from freetoken.config import EngineConfig
from freetoken.engine.async_engine import AsyncEngine
from freetoken.log import logger
from freetoken.server.config import ServerConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


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
    hc.accesslog = None                        # the server logs one line per generation request
    http_log = logging.getLogger("freetoken.http")
    http_log.setLevel(logging.WARNING)         # hypercorn's own "Running on" line is replaced by ours
    hc.errorlog = http_log
    hc.graceful_timeout = config.shutdown_timeout
    hc.include_server_header = False
    return hc


async def serve_engine(engine: AsyncEngine, model_dir, config: ServerConfig,
                       stop: asyncio.Event | None = None, on_bound=None) -> int:
    """Serve `engine` (not yet started) until `stop` is set or a signal arrives."""
    from hypercorn.asyncio.run import worker_serve
    from hypercorn.utils import wrap_app

    from freetoken.server.app import build_app
    from freetoken.server.state import ServerState

    state = ServerState(engine, config, model_dir)
    hc = hypercorn_config(config)
    sockets = hc.create_sockets()
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
    exit_code = [0]
    threading.Thread(target=_announce, args=(engine, state, url, loop, stop, exit_code), daemon=True).start()

    async def shutdown_trigger():
        await stop.wait()
        logger.info("shutting down: aborting open requests")
        await asyncio.to_thread(engine.shutdown)

    try:
        await worker_serve(wrap_app(build_app(state), hc.wsgi_max_body_size, "asgi"), hc,
                           sockets=sockets, shutdown_trigger=shutdown_trigger)
    finally:
        await asyncio.to_thread(engine.shutdown)
    return exit_code[0]


def _announce(engine: AsyncEngine, state, url: str, loop, stop: asyncio.Event, exit_code: list) -> None:
    """Engine-load watcher: the ready line, or an error and a shutdown when loading failed."""
    if engine.wait_ready():
        print(f"[freetoken] ready: {url} (model {state.model!r}, loaded in {engine.load_seconds:.1f} s)",
              file=sys.stdout, flush=True)
        return
    if engine.state == "failed":
        logger.error("could not start the engine: %s", engine.error)
        exit_code[0] = 1
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
