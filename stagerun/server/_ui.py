"""The web page ``stagerun serve`` shows at ``/``: a chat with the model, and the pipeline live.

Theory of operation: the page is three static files shipped in the package (``ui/``) and
served as they are: no build step, nothing fetched from anywhere else at run time. Every answer
here carries a strict Content-Security-Policy (`CSP`: scripts, styles and connections to this
server only, no inline code, no frames, no plugins), so even a bug that let model output into
the document as HTML could not run it; the page writes all text with ``textContent`` anyway.

The chat speaks the OpenAI API like any other client: SSE streams from
``/v1/chat/completions`` and ``/v1/completions`` (the page's stop button aborts the fetch; the
server sees a client that went away and cancels the generation, which
``stagerun_client_disconnects_total`` counts). The pipeline view polls ``/ui/state``: the
detailed ``/health`` (every stage's layers, backend, address, state, restarts and prefix
cache; the lanes; requests running and queued; KV reserved), with each stage's busy share
since the previous snapshot and its forwards per tick between probes, and the ``timeline``
of the latest request (`stagerun.server._ui_timeline`: its computes on every stage, its
verify windows, its recoveries). It holds no request's text or id, and it is built at most
once per `STATE_INTERVAL` seconds however many pages poll: later polls get the same
snapshot. The stages are probed (a handshake each, asking for the latest request's recent
work) for every snapshot while that request runs or has just ended, else once per
`PROBE_INTERVAL`; the rest (process states, busy shares, requests, KV) is read fresh for
each snapshot. It needs what the detailed ``/health`` needs (an API key, on a server with
keys); the page itself does not, and asks for the key when the API answers 401.
"""

from __future__ import annotations

import importlib.resources
import time
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ._clients import client_of
from ._health import detailed_health
from ._openai import ApiError
from ._state import server_state
from ._ui_timeline import recent_batches, timeline

# Seconds a /ui/state snapshot is served before the next poll builds a new one.
STATE_INTERVAL = 1.0
# Seconds between the stage probes (a handshake with every stage) behind the snapshots while
# no request runs; the supervised processes' states, busy shares and requests are read fresh
# for each snapshot.
PROBE_INTERVAL = 5.0
#: Every answer of the page's routes: nothing but this server, no inline code, no framing.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
# name -> media type of the files served (nothing else in the folder is reachable)
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def page_file(name: str) -> bytes:
    """The bytes of one of the page's `FILES`."""
    return importlib.resources.files(__package__).joinpath("ui", name).read_bytes()


class _Snapshot:
    """The latest /ui/state document, and when it was built; one build at a time."""

    def __init__(self) -> None:
        self.body: dict[str, Any] | None = None
        self.health: Any = None  # the stages' latest probes
        self.batches: dict[int, float] = {}  # each stage's forwards per tick between probes
        self.probed = -float("inf")
        self.built = -float("inf")
        self.lock = trio.Lock()


async def index(request: Request) -> Response:
    return Response(page_file("index.html"), media_type=FILES["index.html"], headers=_HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES or name == "index.html":
        raise ApiError(404, f"there is no /ui/{name}", code="not_found")
    return Response(page_file(name), media_type=FILES[name], headers=_HEADERS)


async def ui_state(request: Request) -> Response:
    """The pipeline view's document (see the module docstring), at most `STATE_INTERVAL` old."""
    if not client_of(request.scope).detail:
        raise ApiError(
            401,
            "the pipeline view needs an API key: 'Authorization: Bearer KEY'",
            type="authentication_error",
            code="invalid_api_key",
        )
    snapshot: _Snapshot = request.app.state.ui_snapshot
    async with snapshot.lock:  # polls that arrive while one builds get its result
        if snapshot.body is None or time.monotonic() - snapshot.built >= STATE_INTERVAL:
            snapshot.body, snapshot.built = await _build(request, snapshot), time.monotonic()
        body = snapshot.body
    return JSONResponse(body, headers=_HEADERS)


async def _build(request: Request, snapshot: _Snapshot) -> dict[str, Any]:
    """A new /ui/state document; the stages are probed first if they are due (every
    `PROBE_INTERVAL`, or every snapshot while the timeline's request runs or just ended)."""
    state = server_state(request)
    record = state.pipeline.live.latest()
    watching = record is not None and (
        record.running or time.perf_counter_ns() - record.ended_ns < 2 * STATE_INTERVAL * 1e9
    )
    if watching or time.monotonic() - snapshot.probed >= PROBE_INTERVAL:
        health = await state.pipeline.check_health(
            timeout=state.http.health_timeout,
            work_of=record.request_id if record is not None else 0,
        )
        snapshot.batches = recent_batches(snapshot.health, health)
        snapshot.health, snapshot.probed = health, time.monotonic()
    body, _status = await detailed_health(request, "ui", snapshot.health)
    for stage in body["stages"]:
        stage["recent_batch"] = snapshot.batches.get(stage["index"])
    body["time"] = time.time()
    body["interval"] = STATE_INTERVAL
    body["client_disconnects"] = state.metrics.disconnects
    body["timeline"] = timeline(record, snapshot.health, time.perf_counter_ns())
    return body


def ui_routes() -> list[Route]:
    """The page's routes (`create_app` adds them unless `HttpConfig.ui` is off)."""
    return [
        Route("/", index, methods=["GET"]),
        Route("/ui/state", ui_state, methods=["GET"]),
        Route("/ui/{name}", asset, methods=["GET"]),
    ]


def new_snapshot() -> _Snapshot:
    return _Snapshot()
