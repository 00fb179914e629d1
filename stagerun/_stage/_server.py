"""The stage server: accept lanes, compute a layer range, forward, sample, reply.

Theory of operation: every accepted connection is one task under the server's nursery. A
connection opens with the handshake; its role says what it is:

* ``LANE``: one hop of a chain, carried out in order by a `stagerun._stage._worker.LaneWorker`:
  compute through the backend, then forward downstream or, on the last stage, sample and
  reply over the return connection. The forwards of every lane go through one
  `stagerun._engine._batcher.TickBatcher`: one batched forward at a time per stage, over
  whatever every lane has ready.
* ``RETURN``: stage 0's return connection for one chain, parked under its key until a
  ``Configure`` with that key binds it (last stage only).

When a lane's upstream goes away, the task drops its sessions and closes its downstream (and,
on the last stage, the bound return connection), so the break travels down the chain and
reaches stage 0 at once.

Connection limits: whoever connects holds one of the stage's open files until the connection
closes, so what peers can hold is bounded (`ConnectionTable`). At most ``max_handshakes``
connections are in their handshake: one more closes the oldest of them (a flood of silent
sockets then holds that many and no more, and an honest peer, the newest, finishes first). At
most ``max_connections`` are open: one more closes a handshake in progress, else the one
quiet longest (an idle lane, which stage 0 replaces when it finds it closed at checkout). A
connection that carries no byte either way for ``idle_timeout`` is closed. At start the
open-file limit is raised to its hard limit, and ``max_connections`` kept below it, so the
stage never runs out of files for an honest peer or for its own downstream hops.

Partial frames: a peer that sends all of a frame but its last byte makes the stage hold what it
sent, so what partial frames hold is bounded per connection and over the stage. Until a lane
has sent its first ``Configure``, its frames carry at most `PRE_REQUEST_PAYLOAD_BYTES` of
activations (a decode or a short verify window, which gets its "not configured" ``Error``); a
return connection's carry none (stage 0 never writes there). A prefix that announces more
closes the connection before anything more is read, so such a connection holds a header (1 MiB
at most) and 64 KiB. After a ``Configure``, a lane's payloads may reach ``max_payload_bytes``
(the model's longest message). All connections' partial frames together hold at most
``max_partial_bytes`` (`stagerun._wire._budget`): a frame's bytes are read only as they
arrive, each read charged before it is made, and when a connection needs room the stalest
partial frame (the one longest without a byte) gives way: its connection is closed. A flood
of partial frames holds the budget only until someone else is receiving.

Who may connect: a stage without a lane secret that listens beyond loopback refuses to start
unless ``insecure`` (``--insecure``) says so; on loopback it warns that any local process can
hand it work.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from typing import Any

import trio

from .. import _proto, plugins
from .._engine import Grammars, PrefixCache, SessionBudget, StageEngine, TickBatcher, model_grammars
from .._engine._config import DEFAULT_IDLE_TIMEOUT as DEFAULT_IDLE_TIMEOUT
from .._engine._config import DEFAULT_MAX_CONNECTIONS as DEFAULT_MAX_CONNECTIONS
from .._engine._config import DEFAULT_MAX_HANDSHAKES as DEFAULT_MAX_HANDSHAKES
from .._engine._config import StageConfig
from .._errors import LaneError, LaneHandshakeError, ProtocolError, StageError
from .._util import FD_RESERVE, raise_open_file_limit
from .._wire._budget import PartialFrameBudget, PartialFrames
from .._wire._connect import alternatives
from .._wire._framed import FrameStream, server_handshake
from ..abc import ComputeBackend
from ..model import ModelFile
from ._connections import Connection, ConnectionTable, TrackedStream
from ._exposure import PLAIN_SCHEMES as PLAIN_SCHEMES
from ._exposure import _warn_if_open as _warn_if_open  # tests call it
from ._exposure import check_exposure
from ._worker import LaneWorker

log = logging.getLogger("stagerun.stage")

SINK_WAIT_SECONDS = 5.0
PRESSURE_LOG_SECONDS = 10.0  # one warning this often at most about connections closed for room
# The activations one frame may carry on a lane before its first Configure, and why more is
# refused (a return connection's frames carry none).
PRE_REQUEST_PAYLOAD_BYTES = 64 << 10
NO_PAYLOAD_YET = (
    f" (before its first Configure a lane's frames carry at most {PRE_REQUEST_PAYLOAD_BYTES} "
    "bytes of activations, a return connection's none)"
)


class StageServer:
    """Serves one layer range of a model to upstream lanes.

    Args:
        backend: the compute backend for this stage's layers.
        config: every setting of the stage (`stagerun._engine.StageConfig`, which documents
            them); it must suit ``backend`` (a downstream unless it holds the last layer).
        settings: `StageConfig` fields by name, in place of ``config`` or replacing some of
            its settings: ``StageServer(backend, index=1, max_sessions=3)``.

    Raises:
        ValueError: a setting is out of range, or contradicts the backend.
    """

    def __init__(
        self,
        backend: ComputeBackend,
        config: StageConfig | None = None,
        *,
        grammars: Grammars | None = None,
        **settings: Any,
    ) -> None:
        config = StageConfig.from_settings(config, settings)
        config.check_backend(backend.layers, backend.is_last)
        self.config = config
        self.backend = backend
        self.index = config.index
        self.downstream = config.downstream
        self.is_last = config.downstream is None
        self.wire_dtype = config.wire_dtype
        self.link = config.link
        self.secret = config.resolve_secret()
        self.handshake_timeout = config.handshake_timeout
        self.address: str | None = None
        self.reply_timeout = config.reply_timeout
        self.engine = StageEngine(
            backend,
            index=config.index,
            max_batch=config.max_batch,
            tick_rows=config.tick_rows,
            inline_seconds=config.inline_compute_ms / 1e3,
            max_sessions=config.max_sessions,
            max_kv_tokens=config.max_kv_tokens,
            prefix_cache_bytes=config.prefix_cache_bytes,
            grammars=grammars if grammars is not None else model_grammars(backend),
        )
        self.refused = 0  # connections turned down in the handshake
        self._stall_logged = False  # the current stall (`_check_hello`) was logged
        self.protocol_errors = 0  # lanes closed for a malformed frame
        self.max_connections = config.max_connections  # as asked; `connection_limit` holds
        self.idle_timeout = config.idle_timeout
        self.max_payload_bytes = config.max_payload_bytes
        self.partial_frames = PartialFrameBudget(config.partial_budget())
        self.turned_away = 0  # connections closed to stay within the limits
        self.idled_out = 0  # connections closed after idle_timeout without a byte
        self._connections = ConnectionTable(
            max_connections=config.max_connections, max_handshakes=config.max_handshakes
        )
        self._turned_away_unlogged = 0
        self._pressure_logged_at = -math.inf
        self._sinks: dict[int, FrameStream] = {}
        self._sink_parked = trio.Condition()
        self._workers: set[LaneWorker] = set()

    def __repr__(self) -> str:
        lo, hi = self.backend.layers
        return (
            f"<StageServer index={self.index} layers={lo}..{hi} address={self.address} "
            f"connections={len(self._connections)}/{self.connection_limit} "
            f"lanes={self.lanes_open} sinks={len(self._sinks)} sessions={self.sessions_open} "
            f"partial={self.partial_frames.held}/{self.partial_frames.max_bytes} "
            f"computes={self.computes} stale_dropped={self.stale_dropped} "
            f"stale_stopped={self.stale_stopped}>"
        )

    # What the engine counts, read where the stage is: its repr, tests, summaries.
    @property
    def batcher(self) -> TickBatcher:
        return self.engine.batcher

    @property
    def session_budget(self) -> SessionBudget:
        return self.engine.budget

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.engine.prefix_cache

    @property
    def computes(self) -> int:
        return self.engine.computes

    @property
    def stale_dropped(self) -> int:
        return self.engine.stale_dropped

    @property
    def stale_stopped(self) -> int:
        return self.engine.stale_stopped

    @property
    def stale_stopped_layers(self) -> collections.Counter[int]:
        return self.engine.stale_stopped_layers

    @property
    def lanes_open(self) -> int:
        """Upstream lanes this stage is carrying out now."""
        return len(self._workers)

    @property
    def sessions_open(self) -> int:
        """Requests configured on this stage's open lanes and not yet stopped."""
        return sum(len(worker.sessions) for worker in self._workers)

    @property
    def connection_limit(self) -> int:
        """Connections this stage holds open at most (``max_connections``, or less at start)."""
        return self._connections.max_connections

    @property
    def handshakes_in_progress(self) -> int:
        """Connections accepted that have not finished their handshake yet."""
        return self._connections.handshaking

    async def serve(
        self,
        address: str | None = None,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``address`` (default: the configuration's ``listen``) and serve until
        cancelled; reports the bound address.

        The address's scheme picks the transport plugin (``tcp://``, ``ws://``, ...).
        """
        address = self.config.listen if address is None else address
        if self.downstream is not None:  # fail early on an address nobody serves
            for candidate in alternatives(self.downstream):
                plugins.transport_for(candidate)
        transport = plugins.transport_for(address)
        check_exposure(address, self.secret, self.index, insecure=self.config.insecure)
        self._limit_connections(raise_open_file_limit())
        async with trio.open_nursery() as nursery:
            if self.idle_timeout < math.inf:
                nursery.start_soon(self._close_idle_connections)
            self.address = await nursery.start(
                functools.partial(transport.serve, address, self._on_connection)
            )
            log.info(
                "stage %d serving layers %s on %s", self.index, self.backend.layers, self.address
            )
            task_status.started(self.address)

    def _check_hello(self, hello: _proto.Hello) -> str | None:
        stall = self.engine.batcher.stall(self.config.stall_timeout)
        self._stall_logged = self._stall_logged and stall is not None
        if stall is not None:  # a liveness probe must not find it alive
            if not self._stall_logged:
                log.warning("stage %d: %s; refusing handshakes until it moves", self.index, stall)
                self._stall_logged = True
            return f"stage {self.index}'s {stall}"
        if hello.role == _proto.Role.RETURN and not self.is_last:
            return f"stage {self.index} is not the last stage and takes no return connections"
        if hello.role == _proto.Role.RETURN and hello.key in self._sinks:
            return "a return connection with this key is already open"
        return None

    def _limit_connections(self, open_files: int | None) -> None:
        """Keep the connection limit below what ``open_files`` leaves room for."""
        if open_files is None:
            return
        table = self._connections
        per_connection = 1 if self.is_last else 2  # a middle stage's lane opens its next hop
        room = max(1, (open_files - FD_RESERVE) // per_connection)
        if room < self.max_connections:
            log.info(
                "stage %d takes at most %d connections: its open-file limit is %d "
                "(raise the hard limit, ulimit -Hn, to take more)",
                self.index,
                room,
                open_files,
            )
        table.max_connections = min(self.max_connections, room)
        table.max_handshakes = min(table.max_handshakes, table.max_connections)

    async def _close_idle_connections(self) -> None:
        """Close every connection that has carried no byte for ``idle_timeout`` seconds.

        A return connection bound to a live lane is not idle (a long prefill sends nothing
        back until its end): the lane's own connection is, and the lane closes it with itself.
        """
        while True:
            now = trio.current_time()
            for conn in self._connections.quiet_since(now - self.idle_timeout):
                if conn.in_use():
                    self._connections.touch(conn, now)  # look again an idle timeout later
                    continue
                self._connections.discard(conn)
                self.idled_out += 1
                log.info(
                    "stage %d: closing the connection from %s: no traffic for %gs",
                    self.index,
                    conn.peer,
                    self.idle_timeout,
                )
                conn.scope.cancel(reason=f"idle for {self.idle_timeout:g}s")
            # Connections that come later, or carry bytes meanwhile, go quiet later still.
            quietest = self._connections.quietest()
            await trio.sleep_until((quietest.last_active if quietest else now) + self.idle_timeout)

    def _turn_away(self, conn: Connection, reason: str) -> None:
        """Close ``conn`` to make room; warn now and then (a flood would flood the log)."""
        self.turned_away += 1
        self._turned_away_unlogged += 1
        conn.scope.cancel(reason=reason)
        now = trio.current_time()
        if now >= self._pressure_logged_at + PRESSURE_LOG_SECONDS:
            log.warning(
                "stage %d closed %d connection(s) to make room (%s; the latest from %s): if "
                "honest peers need that many, raise the limit; else someone is flooding it",
                self.index,
                self._turned_away_unlogged,
                reason,
                conn.peer,
            )
            self._pressure_logged_at, self._turned_away_unlogged = now, 0

    async def _on_connection(self, stream: trio.abc.Stream, peer: str) -> None:
        conn = Connection(peer, trio.current_time())
        for victim, reason in self._connections.admit(conn):
            self._turn_away(victim, reason)
        partial = self.partial_frames.account(peer, lambda why: self._turn_away(conn, why))
        try:
            with conn.scope:
                tracked = TrackedStream(stream, conn, self._connections)
                await self._serve_connection(tracked, conn, partial)
        finally:
            partial.release()
            self._connections.discard(conn)
            await trio.aclose_forcefully(stream)

    async def _serve_connection(
        self, stream: trio.abc.Stream, conn: Connection, partial: PartialFrames
    ) -> None:
        peer = conn.peer
        try:
            framed, hello = await server_handshake(
                stream,
                peer=peer,
                hello_timeout=self.handshake_timeout,
                check=self._check_hello,
                link=self.link,
                secret=self.secret,
                max_payload_bytes=0,  # see "Partial frames" above
                partial=partial,
            )
        except LaneHandshakeError as exc:
            self.refused += 1
            log.info("stage %d: %s", self.index, exc)
            return
        before_configure = 0 if hello.role == _proto.Role.RETURN else PRE_REQUEST_PAYLOAD_BYTES
        framed.limit_payloads(min(before_configure, self.max_payload_bytes), note=NO_PAYLOAD_YET)
        self._connections.established(conn)
        if hello.role == _proto.Role.RETURN:
            await self._park_sink(framed, hello.key, conn)
        else:
            await self._run_lane(framed)

    async def _run_lane(self, framed: FrameStream) -> None:
        worker = LaneWorker(self, framed)
        self._workers.add(worker)
        try:
            await worker.run()
        except Exception as exc:
            ended = _lane_errors(exc)
            if ended is None:
                # A bug in one lane must not take the stage down: that lane is closed (its
                # chain collapses and stage 0 replaces it); the other lanes carry on.
                log.exception("stage %d: lane from %s failed", self.index, framed.peer)
                return
            # The lane's connections failed (several tasks may see it): not a bug.
            self.protocol_errors += sum(isinstance(e.__cause__, ProtocolError) for e in ended)
            reasons = "; ".join(dict.fromkeys(str(e) for e in ended))
            log.info("stage %d: lane from %s ended: %s", self.index, framed.peer, reasons)
        finally:
            self._workers.discard(worker)

    async def _park_sink(self, framed: FrameStream, key: int, conn: Connection) -> None:
        # Bound to a lane's session, it waits quietly for predictions as long as the lane lives.
        conn.in_use = lambda: any(worker.sink is framed for worker in self._workers)
        async with self._sink_parked:
            self._sinks[key] = framed
            self._sink_parked.notify_all()
        try:
            frame = await framed.receive()  # stage 0 never writes here; wait for the close
            log.warning("stage %d: unexpected %s on a return connection", self.index, frame)
        except LaneError:
            pass
        finally:
            if self._sinks.get(key) is framed:
                del self._sinks[key]
            await framed.aclose_forcefully()

    async def take_sink(self, key: int) -> FrameStream:
        """The parked return connection for ``key`` (waits briefly for it to arrive)."""
        with trio.move_on_after(SINK_WAIT_SECONDS):
            async with self._sink_parked:
                while key not in self._sinks:
                    await self._sink_parked.wait()
                return self._sinks[key]
        raise StageError(f"stage {self.index} has no return connection for this lane")


def _lane_errors(exc: Exception) -> list[LaneError] | None:
    """The `LaneError` ``exc`` is, or every leaf of its group if all are; else None."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc] if isinstance(exc, LaneError) else None
    found: list[LaneError] = []

    def lane_error(leaf: BaseException) -> bool:
        if isinstance(leaf, LaneError):
            found.append(leaf)  # split visits the leaves in order
            return True
        return False

    _, rest = exc.split(lane_error)
    return found if rest is None else None


def payload_limit(model: ModelFile) -> int:
    """The largest activation payload an honest upstream sends a stage of ``model``.

    A prefill sends at most the whole context in one message (the ``unchunked`` policy), in
    float32 at most: anything larger is refused from its frame's prefix, before it is read.
    """
    c = model.config
    return min(_proto.DEFAULT_MAX_PAYLOAD_BYTES, c.context_length * c.d_model * 4)


async def serve_stage(
    backend: ComputeBackend,
    config: StageConfig | None = None,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    **settings: Any,
) -> None:
    """Serve one stage on its configuration's ``listen`` address until cancelled.

    ``await nursery.start(serve_stage, backend, config)`` gives the address it really
    listens on. ``config`` and ``settings`` are `StageServer`'s.
    """
    server = StageServer(backend, config, **settings)
    await server.serve(task_status=task_status)
