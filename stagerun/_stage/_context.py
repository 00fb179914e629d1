"""What a lane worker may see of its stage: a small protocol instead of the whole server.

`stagerun._stage._server.StageServer` implements it. A worker reads the stage's settings,
computes through `forward` (the stage's tick scheduler batches every lane's forwards), takes
parked return connections, charges its sessions to the stage's `SessionBudget`, and adds to
the stage's counters; it never reaches the server's listeners, handshake or other workers.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._engine._config import StageConfig
from .._proto import ActivationDType
from .._wire._framed import FrameStream, LinkEmulation
from ..abc import ComputeBackend, ForwardItem
from ._scheduler import TickInfo

if TYPE_CHECKING:
    from ._budget import SessionBudget
    from ._prefix import PrefixCache


class StageContext(Protocol):
    config: StageConfig  # every setting of the stage (its downstream dial's among them)
    index: int
    backend: ComputeBackend
    downstream: str | None  # the next stage (and its standbys), None on the last stage
    is_last: bool
    wire_dtype: ActivationDType
    link: LinkEmulation
    reply_timeout: float  # the deadline of every write to a peer (upstream, downstream, sink)
    session_budget: SessionBudget  # what the sessions of all lanes may hold together
    prefix_cache: PrefixCache | None  # KV blocks of earlier requests' prefixes (None: off)
    # counters the workers add to; the server reports them
    protocol_errors: int
    stale_dropped: int
    stale_stopped: int
    stale_stopped_layers: collections.Counter[int]

    async def take_sink(self, key: int) -> FrameStream:
        """The parked return connection for ``key`` (the last stage binds it at Configure)."""
        ...

    async def forward(
        self,
        item: ForwardItem,
        *,
        prefill: bool = False,
        stale: Callable[[], bool] | None = None,
        tick: TickInfo | None = None,
    ) -> np.ndarray[Any, Any]:
        """Compute one session's forward in the stage's next tick that takes it (``tick``,
        if given, is filled in with that tick's start, duration and size)."""
        ...
