"""What a lane worker may see of its stage: a small protocol instead of the whole server.

`stagerun._stage._server.StageServer` implements it. A worker reads the stage's settings,
hands every session's work to the stage's `stagerun._engine.StageEngine` (which batches every
lane's forwards, holds the prefix cache and charges the session budget), takes parked return
connections, and counts the lanes it closes for protocol errors; it never reaches the
server's listeners, handshake or other workers.
"""

from __future__ import annotations

from typing import Protocol

from .._engine import StageEngine
from .._engine._config import StageConfig
from .._proto import ActivationDType
from .._wire._framed import FrameStream, LinkEmulation
from ..abc import ComputeBackend


class StageContext(Protocol):
    config: StageConfig  # every setting of the stage (its downstream dial's among them)
    index: int
    backend: ComputeBackend
    engine: StageEngine  # the stage's compute, prefix cache, session budget, stale counters
    downstream: str | None  # the next stage (and its standbys), None on the last stage
    is_last: bool
    wire_dtype: ActivationDType
    link: LinkEmulation
    reply_timeout: float  # the deadline of every write to a peer (upstream, downstream, sink)
    protocol_errors: int  # lanes closed for a malformed frame; the workers add to it

    async def take_sink(self, key: int) -> FrameStream:
        """The parked return connection for ``key`` (the last stage binds it at Configure)."""
        ...
