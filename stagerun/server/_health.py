"""``/health`` and ``/metrics``: each stage's probe and busy share, the lanes, the requests.

Both show what a stranger should not see (stage addresses, process ids, cache counts): a
request that may not see them (`Client.detail`) gets ``/health``'s liveness alone, its status
with 200 or 503 and nothing else, and ``/metrics`` refuses it before it gets here (401).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .._driver._pipeline import Pipeline
from .._driver._supervise import NOT_SERVING, StageProcess, is_serving
from .._driver._values import StageHealth
from ._clients import client_of
from ._metrics import CONTENT_TYPE, BusySampler, tick_summary
from ._state import server_state


def _busy(request: Request, endpoint: Literal["health", "metrics", "ui"]) -> dict[int, float]:
    """Each stage's busy fraction since ``endpoint``'s previous call (see `BusySampler`)."""
    sampler: BusySampler = request.app.state.busy[endpoint]
    return sampler.sample()


def _stage_entries(
    pipeline: Pipeline, health: Sequence[StageHealth], busy: dict[int, float]
) -> list[dict[str, Any]]:
    """``/health``'s stages: each probe, its ``busy`` fraction, and stage 0's ``batch``.

    A supervised stage whose process is not running has that process's state as its own
    (``starting``, ``restarting``, ``failed``; the handshake's result is kept as ``probe``):
    whatever answers on its address then is not that process.
    """
    entries = [h.to_json() for h in health]
    for h, entry in zip(health, entries, strict=True):
        process = h.stage.process
        if isinstance(process, StageProcess) and process.state in NOT_SERVING:
            entry["probe"], entry["state"] = entry["state"], process.state
        if entry["index"] in busy:
            entry["busy"] = round(busy[entry["index"]], 4)
        if entry["index"] == 0:
            entry["batch"] = tick_summary(pipeline.batcher)
    return entries


async def health(request: Request) -> Response:
    if not client_of(request.scope).detail:
        state = server_state(request)
        health = await state.pipeline.check_health(timeout=state.http.health_timeout)
        healthy = all(is_serving(h) for h in health)
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=status)
    body, status = await detailed_health(request, "health")
    return JSONResponse(body, status_code=status)


async def detailed_health(
    request: Request,
    endpoint: Literal["health", "ui"],
    health: Sequence[StageHealth] | None = None,
) -> tuple[dict[str, Any], int]:
    """The detailed ``/health`` document and its status (200, or 503 when a stage does not
    serve); busy shares are since ``endpoint``'s previous call. ``health``: the stages'
    probes, if they were just taken (else they are taken now)."""
    state = server_state(request)
    if health is None:
        health = await state.pipeline.check_health(timeout=state.http.health_timeout)
    healthy = all(is_serving(h) for h in health)
    busy = _busy(request, endpoint)
    pool = state.pipeline.pool
    lanes = None
    if pool is not None:
        lanes = {
            "capacity": pool.capacity,
            "idle": pool.idle,
            "busy": pool.busy,
            "replaced": pool.replaced,
            "replace_failures": pool.replace_failures,
        }
    adm = state.admission
    body = {
        "status": "ok" if healthy else "unhealthy",
        "model": state.model_id,
        "stages": _stage_entries(state.pipeline, health, busy),
        "lanes": lanes,
        "requests": {
            "running": adm.running,
            "queued": adm.queued,
            "max_batch": adm.max_batch,
            "max_queue": adm.max_queue,
            "rejected": adm.rejected,
            "kv_reserved_bytes": adm.reserved,
            "kv_budget_bytes": adm.kv_budget,
        },
    }
    return body, 200 if healthy else 503


async def metrics(request: Request) -> Response:
    state = server_state(request)
    health = await state.pipeline.check_health(timeout=state.http.health_timeout)
    text = state.metrics.render(
        admission=state.admission,
        pool=state.pipeline.pool,
        health=health,
        pipeline=state.pipeline,
        busy=_busy(request, "metrics"),
    )
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
