"""The stage server: accept lanes, compute a layer range, forward, sample, reply.

Theory of operation: every accepted connection is one task under the server's nursery. A
connection opens with the handshake; its role says what it is:

* ``LANE``: one hop of a chain, carried out in order by a `stagerun._stage._worker.LaneWorker`:
  compute through the backend, then forward downstream or, on the last stage, sample and
  reply over the return connection. The forwards of every lane go through one
  `stagerun._stage._scheduler.TickScheduler`: one batched forward at a time per stage, over
  whatever every lane has ready.
* ``RETURN``: stage 0's return connection for one chain, parked under its key until a
  ``Configure`` with that key binds it (last stage only).

When a lane's upstream goes away, the task drops its sessions and closes its downstream (and,
on the last stage, the bound return connection), so the break travels down the chain and
reaches stage 0 at once.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from .. import _proto, plugins
from .._decide._ticks import DEFAULT_TICK_ROWS
from .._errors import LaneError, LaneHandshakeError, StageError
from .._wire._address import parse_address
from .._wire._auth import SECRET_FILE_ENV, is_loopback, lane_secret
from .._wire._connect import ENV_SECRET, EnvSecret, alternatives, stage_reply_timeout
from .._wire._framed import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    NO_EMULATION,
    FrameStream,
    LinkEmulation,
    server_handshake,
)
from ..abc import ComputeBackend, ForwardItem
from ._scheduler import TickInfo, TickScheduler
from ._worker import LaneWorker

log = logging.getLogger("stagerun.stage")

SINK_WAIT_SECONDS = 5.0


class StageServer:
    """Serves one layer range of a model to upstream lanes.

    Args:
        backend: the compute backend for this stage's layers.
        index: this stage's position in the pipeline (0 is the driver, so servers are >= 1).
        downstream: address of the next stage, or None on the last stage; several addresses
            separated by commas are the next stage and its standbys, tried in order.
        wire_dtype: activation dtype used when forwarding downstream.
        handshake_timeout: seconds a connecting peer has to send its hello (and, with a lane
            secret, its nonce and proof); a peer that stalls is dropped after that.
        max_batch: sessions one tick computes together at most (1: no batching).
        tick_rows: rows one tick computes at most (a larger forward runs alone).
    """

    def __init__(
        self,
        backend: ComputeBackend,
        *,
        index: int,
        downstream: str | None = None,
        wire_dtype: _proto.ActivationDType = "f32",
        link: LinkEmulation = NO_EMULATION,
        secret: bytes | EnvSecret | None = ENV_SECRET,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_batch: int | None = None,
        tick_rows: int = DEFAULT_TICK_ROWS,
    ) -> None:
        if not (0 < handshake_timeout < math.inf):
            raise ValueError(
                f"handshake_timeout must be a positive number of seconds, got {handshake_timeout}"
            )
        if downstream is None and not backend.is_last:
            lo, hi = backend.layers
            raise ValueError(
                f"stage {index} holds layers {lo}..{hi} but has no downstream stage; "
                "give it --downstream or let it hold the model's last layer"
            )
        if downstream is not None and backend.is_last:
            raise ValueError(f"stage {index} holds the model's last layer but has a downstream")
        self.backend = backend
        self.index = index
        self.downstream = downstream
        self.is_last = downstream is None
        self.wire_dtype = wire_dtype
        self.link = link
        self.secret = lane_secret() if isinstance(secret, EnvSecret) else secret
        self.handshake_timeout = handshake_timeout
        self.address: str | None = None
        self.reply_timeout = stage_reply_timeout()
        self.refused = 0  # connections turned down in the handshake
        self.protocol_errors = 0  # lanes closed for a malformed frame
        self.scheduler = TickScheduler(backend, max_rows=tick_rows, max_items=max_batch)
        self._sinks: dict[int, FrameStream] = {}
        self._sink_parked = trio.Condition()
        self.lanes_open = 0
        self.computes = 0
        self.stale_dropped = 0  # stale windows dropped before their compute started
        self.stale_stopped = 0  # stale windows whose compute stopped at a layer boundary
        # ... and the layer each stopped before (strictly inside this stage's layers)
        self.stale_stopped_layers: collections.Counter[int] = collections.Counter()
        self._workers: set[LaneWorker] = set()

    def __repr__(self) -> str:
        lo, hi = self.backend.layers
        return (
            f"<StageServer index={self.index} layers={lo}..{hi} address={self.address} "
            f"lanes={self.lanes_open} sinks={len(self._sinks)} sessions={self.sessions_open} "
            f"computes={self.computes} stale_dropped={self.stale_dropped} "
            f"stale_stopped={self.stale_stopped}>"
        )

    @property
    def sessions_open(self) -> int:
        """Requests configured on this stage's open lanes and not yet stopped."""
        return sum(len(worker.sessions) for worker in self._workers)

    async def serve(
        self,
        address: str = "tcp://127.0.0.1:0",
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``address`` and serve until cancelled; reports the bound address.

        The address's scheme picks the transport plugin (``tcp://``, ``ws://``, ...).
        """
        if self.downstream is not None:  # fail early on an address nobody serves
            for candidate in alternatives(self.downstream):
                plugins.transport_for(candidate)
        transport = plugins.transport_for(address)
        _warn_if_open(address, self.secret, self.index)
        async with trio.open_nursery() as nursery:
            self.address = await nursery.start(
                functools.partial(transport.serve, address, self._on_connection)
            )
            log.info(
                "stage %d serving layers %s on %s", self.index, self.backend.layers, self.address
            )
            task_status.started(self.address)

    def _check_hello(self, hello: _proto.Hello) -> str | None:
        if hello.role == _proto.Role.RETURN and not self.is_last:
            return f"stage {self.index} is not the last stage and takes no return connections"
        if hello.role == _proto.Role.RETURN and hello.key in self._sinks:
            return "a return connection with this key is already open"
        return None

    async def _on_connection(self, stream: trio.abc.Stream, peer: str) -> None:
        try:
            framed, hello = await server_handshake(
                stream,
                peer=peer,
                hello_timeout=self.handshake_timeout,
                check=self._check_hello,
                link=self.link,
                secret=self.secret,
            )
        except LaneHandshakeError as exc:
            self.refused += 1
            log.info("stage %d: %s", self.index, exc)
            await trio.aclose_forcefully(stream)
            return
        if hello.role == _proto.Role.RETURN:
            await self._park_sink(framed, hello.key)
        else:
            self.lanes_open += 1
            worker = LaneWorker(self, framed)
            self._workers.add(worker)
            try:
                await worker.run()
            except Exception:
                # A bug in one lane must not take the stage down: that lane is closed (its
                # chain collapses and stage 0 replaces it); the other lanes carry on.
                log.exception("stage %d: lane from %s failed", self.index, peer)
            finally:
                self._workers.discard(worker)
                self.lanes_open -= 1

    async def _park_sink(self, framed: FrameStream, key: int) -> None:
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

    async def forward(
        self,
        item: ForwardItem,
        *,
        prefill: bool = False,
        stale: Callable[[], bool] | None = None,
        tick: TickInfo | None = None,
    ) -> np.ndarray[Any, Any]:
        """Compute one session's forward in this stage's next tick (see `TickScheduler`)."""
        self.computes += 1
        return await self.scheduler.forward(item, prefill=prefill, stale=stale, tick=tick)


def _warn_if_open(address: str, secret: bytes | None, index: int) -> None:
    """Warn when a stage without a lane secret listens beyond this machine."""
    if secret is not None:
        return
    try:
        _scheme, host, _port = parse_address(address)
    except ValueError:
        return  # a plugin's address form (unix://...): its own business
    if not is_loopback(host):
        log.warning(
            "stage %d serves %s without lane authentication: anyone who can reach it can "
            "send it work. Give every stage the same --secret-file (or $%s).",
            index,
            address,
            SECRET_FILE_ENV,
        )


async def serve_stage(
    backend: ComputeBackend,
    *,
    index: int,
    downstream: str | None = None,
    listen: str = "tcp://127.0.0.1:0",
    wire_dtype: _proto.ActivationDType = "f32",
    link: LinkEmulation = NO_EMULATION,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_batch: int | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one stage on ``listen`` until cancelled.

    ``await nursery.start(serve_stage, ...)`` gives the address it really listens on.
    ``handshake_timeout`` and ``max_batch`` are `StageServer`'s.
    """
    server = StageServer(
        backend,
        index=index,
        downstream=downstream,
        wire_dtype=wire_dtype,
        link=link,
        handshake_timeout=handshake_timeout,
        max_batch=max_batch,
    )
    await server.serve(listen, task_status=task_status)
