"""A bound on connections in a transport's own handshake (a TLS handshake, a websocket upgrade).

A stage counts a connection only once its transport hands it over, so a transport that does a
handshake of its own first bounds those connections itself. `Slots` lets at most ``limit`` be
in that phase at once; one more cancels the oldest. A flood of silent sockets therefore holds
``limit`` of them, each for at most the handshake's deadline, and an honest peer (the newest,
and quick) gets through.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["Slots"]

log = logging.getLogger("stagerun.transports")


class Slots:
    """At most ``limit`` connections in ``what`` at once; one more closes the oldest."""

    def __init__(self, limit: int, what: str) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.what = what
        self._held: dict[trio.CancelScope, str] = {}  # to the peer; oldest first, as dicts are

    def __repr__(self) -> str:
        return f"<Slots {self.what} {len(self._held)}/{self.limit}>"

    def __len__(self) -> int:
        return len(self._held)

    @contextmanager
    def slot(self, peer: str) -> Iterator[trio.CancelScope]:
        """Hold a slot for ``peer`` (cancelled, and so left, if a newer one needs room)."""
        with trio.CancelScope() as scope:
            if len(self._held) >= self.limit:
                oldest, oldest_peer = next(iter(self._held.items()))
                del self._held[oldest]
                why = f"over {self.limit} {self.what} in progress"
                log.info("closing the connection from %s: %s", oldest_peer, why)
                oldest.cancel()
            self._held[scope] = peer
            try:
                yield scope
            finally:
                self._held.pop(scope, None)
