"""What partially received frames may hold on a stage, over all its connections together.

Theory of operation
-------------------
A frame's bytes wait in its connection's decoder until the frame is whole; a peer that sends
all of a frame but its last byte makes the stage hold the rest for as long as it likes. What
one connection may hold is bounded by the frame limits its `FrameStream` checks from the
frame's prefix (the stage's rule is in `stagerun._stage._server`); what all of them hold
together is bounded here.

Each connection has a `PartialFrames` account in the stage's `PartialFrameBudget`. It is
charged for what its decoder holds (the bytes, and the token ids of a parsed header), and for
a read of a frame in progress *before* the read is made (`reserve`), so partial frames never
hold more than ``max_bytes`` but for the small first read of each frame
(`stagerun._wire._framed` reads at most 4 KiB when it holds nothing, and charges it when it
lands). A whole frame leaves the budget when it is returned (it is the lane queue's then), and
a connection that holds nothing is no holder.

When a connection needs room that the budget has not got, the partial frame that has gone
longest without a byte -- the stalest holder -- gives way: its connection is closed and its
decoder emptied at once. A read it had reserved stays charged until its task has seen the
close (a socket read that completed is held until then), so a connection that needs room may
wait for that, a scheduling round at most, rather than overdraw. A flood of partial frames thus
holds ``max_bytes`` at most, and loses it to any connection that is receiving, an honest frame
among them: to keep its room, a flooder would have to send a byte on every one of its
connections more often than the honest peer's bytes arrive. Since every holder but the one
asking can be closed, a request is always granted as long as one frame fits in the budget
(`StageConfig` checks that). Honest partial frames give way to one another only when together
they outgrow the budget (by default one largest frame and 12 MiB besides): a burst larger
than that, two full-context prefills arriving at once say, loses its stalest frame.

Bookkeeping, synchronous but for `PartialFrameBudget.wait_for_room`: closing is the ``close``
callback each account was opened with (the stage cancels that connection's scope).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["PartialFrameBudget", "PartialFrames"]


class PartialFrames:
    """One connection's account in a `PartialFrameBudget` (open one with its ``account``)."""

    def __init__(self, budget: PartialFrameBudget, peer: str, close: Callable[[str], None]) -> None:
        self.budget = budget
        self.peer = peer
        self.buffered = 0  # what the decoder holds
        self.reading = 0  # a read reserved and not settled yet
        self.evicted: str | None = None  # why the budget closed this connection
        # What holds the bytes (its `FrameStream` sets it): dropped at once when evicted, not
        # when the closed connection's task next runs, so the freed room is really free.
        self.drop: Callable[[str], None] | None = None
        self._close = close

    def __repr__(self) -> str:
        state = f"evicted ({self.evicted})" if self.evicted else f"buffered={self.buffered}"
        return f"<PartialFrames peer={self.peer} {state} reading={self.reading}>"

    @property
    def held(self) -> int:
        return self.buffered + self.reading

    def reserve(self, wanted: int) -> int:
        """Charge a read of up to ``wanted`` bytes before it is made; the bytes granted (0:
        wait for `PartialFrameBudget.wait_for_room`, then ask again).

        Staler holders are closed to make room.
        """
        budget = self.budget
        budget.make_room(self, wanted)
        granted = max(0, min(wanted, budget.max_bytes - budget.held))
        self._set(self.buffered, self.reading + granted)
        return granted

    def settle(self, buffered: int) -> None:
        """The decoder holds ``buffered`` bytes now and no read is in flight: charge exactly
        that (a read that brought fewer bytes than reserved gives the rest back); staler
        holders make room for what was not reserved."""
        if buffered > self.held:
            self.budget.make_room(self, buffered - self.held)
        self._set(buffered, 0)

    def release(self) -> None:
        """The connection is closing: give everything back."""
        self._set(0, 0)

    def evict(self, reason: str) -> None:
        """Close the connection and empty its decoder now; its read in flight stays charged
        until its task has seen the close (and releases the account)."""
        self.evicted = reason
        self._set(0, self.reading)
        if self.drop is not None:
            self.drop(reason)
        self._close(reason)

    def _set(self, buffered: int, reading: int) -> None:
        budget = self.budget
        freed = self.held - (buffered + reading)
        budget.held -= freed
        self.buffered, self.reading = buffered, reading
        budget.holders.pop(self, None)
        if buffered and self.evicted is None:
            budget.holders[self] = None  # the freshest: dicts keep insertion order
        if freed > 0:
            budget.room_freed.unpark_all()


class PartialFrameBudget:
    """The bytes of partial frames all of a stage's connections may hold together.

    Args:
        max_bytes: the budget; one frame of the largest size must fit in it.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a partial-frame budget must be at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.held = 0
        self.evicted = 0  # connections closed to make room
        self.holders: dict[PartialFrames, None] = {}  # stalest first
        self.room_freed = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        return (
            f"<PartialFrameBudget held={self.held}/{self.max_bytes} "
            f"holders={len(self.holders)} evicted={self.evicted}>"
        )

    def account(self, peer: str, close: Callable[[str], None]) -> PartialFrames:
        """A new connection's account; ``close(reason)`` closes it when it must give way."""
        return PartialFrames(self, peer, close)

    def make_room(self, asking: PartialFrames, more: int) -> None:
        """Close the stalest holders other than ``asking`` until ``more`` bytes fit."""
        while self.held + more > self.max_bytes:
            stalest = next((a for a in self.holders if a is not asking), None)
            if stalest is None:
                return
            self.evicted += 1
            stalest.evict(
                f"partial frames needed more than --max-partial-bytes={self.max_bytes}, and "
                "this one had gone longest without a byte"
            )

    def only_holder(self, asking: PartialFrames) -> bool:
        """True when nothing but ``asking`` holds room (waiting would not help it)."""
        return self.held == asking.held

    async def wait_for_room(self) -> None:
        """Until some account gives room back."""
        await self.room_freed.park()
