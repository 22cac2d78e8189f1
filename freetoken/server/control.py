"""Control routes: /health, /metrics, /v1/cache/status, /v1/cache/rebuild."""
from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from freetoken.engine.request import EngineBusy
from freetoken.log import logger
from freetoken.server.body import read_json
from freetoken.server.errors import APIError
from freetoken.server.protocol import Body

STATUS_TIMEOUT = 10.0        # seconds to wait for the engine thread's snapshot (one step at most)


async def health(request: Request) -> Response:
    state = request.app.state.server
    engine = state.engine
    if engine.state == "ready" and not state.stopping:
        return JSONResponse({"status": "ok", "model": state.model,
                             "uptime_s": round(time.time() - state.started, 1)})
    status = "draining" if state.stopping and engine.state == "ready" else engine.state
    message = {"loading": "the model is loading", "stopped": "the server is shutting down",
               "draining": "the server is shutting down: open requests are finishing"}.get(
        status, f"the engine failed to start: {engine.error}")
    return JSONResponse({"status": status, "error": {"message": message, "type": "unavailable_error",
                                                     "code": 503}}, status_code=503)


async def metrics(request: Request) -> Response:
    state = request.app.state.server
    engine = state.engine
    snapshot = None
    if engine.state == "ready":
        try:
            snapshot = await engine.status(STATUS_TIMEOUT)
        except asyncio.TimeoutError:
            logger.warning("/metrics: the engine thread did not answer within %.0f s", STATUS_TIMEOUT)
    text = state.metrics.render(engine.state, snapshot, engine.counters, engine.decode_tok_s, state.model)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def cache_status(request: Request) -> Response:
    state = request.app.state.server
    engine = state.ready_engine()
    try:
        s = await engine.status(STATUS_TIMEOUT)
    except asyncio.TimeoutError:
        raise APIError(504, "the engine did not answer in time") from None
    return JSONResponse(_status_body(state, s))


async def cache_rebuild(request: Request) -> Response:
    """Resize the MoE expert cache and/or the KV pool while idle; 409 while requests are in flight."""
    state = request.app.state.server
    body = Body(await read_json(request, state.config.max_body_bytes))
    body.only({"moe_cache_size", "num_kv_tokens"})
    # types here; bounds in the engine's plan, the same checks as at start-up (engine/plan.py)
    sizes = {k: body.int(k, None, lo=None, hi=None) for k in ("moe_cache_size", "num_kv_tokens")}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if not sizes:
        raise APIError(400, "give moe_cache_size and/or num_kv_tokens")
    engine = state.ready_engine()
    t0 = time.perf_counter()
    try:
        result = await engine.rebuild_cache(**sizes)
    except EngineBusy as e:
        raise APIError(409, f"the engine is busy: {e}", code="engine_busy") from None
    except NotImplementedError as e:
        raise APIError(501, str(e)) from None
    except ValueError as e:
        raise APIError(400, f"invalid cache geometry: {e}") from None
    except Exception as e:  # noqa: BLE001 - the engine rolled back; report, keep serving
        logger.exception("cache rebuild failed")
        raise APIError(500, f"cache rebuild failed and was rolled back: {e}") from None
    seconds = time.perf_counter() - t0
    state.last_rebuild = {"requested": sizes, "seconds": round(seconds, 3), "at": time.time(),
                          "result": result if isinstance(result, dict) else None}
    logger.info("cache rebuilt in %.2f s: %s", seconds, sizes)
    s = await engine.status(STATUS_TIMEOUT)
    return JSONResponse({"status": "ok", "seconds": round(seconds, 3), **_status_body(state, s)})


def _status_body(state, s: dict) -> dict:
    moe = dict(s.get("moe") or {})
    moe.pop("layers", None)
    kv = {"slots": s["kv_slots"], "free": s["kv_free"], "used": s["kv_slots"] - s["kv_free"],
          "prefix_cached": s["kv_prefix_cached"], "leaked": s["kv_leaked"]}
    return {"state": state.engine.state, "idle": s["idle"], "kv": kv,
            "requests": {"running": s["running"], "waiting": s["waiting"], "in_flight": s["in_flight"]},
            "moe": moe, "geometry": s["geometry"], "last_rebuild": state.last_rebuild,
            **({"state_checkpoints": s["checkpoints"]} if s.get("checkpoints") else {})}
