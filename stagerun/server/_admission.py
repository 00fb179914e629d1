"""Admission: at most ``capacity`` requests generate at once, at most ``max_queue`` wait.

Theory of operation (decide, then do): `Admission.try_admit` decides synchronously, when the
request arrives, whether it runs now, waits in line, or is refused (the handler answers 429
with ``Retry-After``). Only a waiting request then awaits, in `Ticket.wait`. A finished request
hands its slot straight to the first waiter, so the line is FIFO and a newcomer never jumps it.
A waiter that is cancelled (its client went away) leaves the line; one that was handed a slot
at the moment it was cancelled gives the slot on. ``capacity`` is the lane pool's size, so a
running request always finds a lane.
"""

from __future__ import annotations

import collections
import enum

import trio


class TicketState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RELEASED = "released"


class Ticket:
    """One admitted request's claim on a slot; `release` it exactly when done (idempotent)."""

    def __init__(self, admission: Admission, state: TicketState) -> None:
        self._admission = admission
        self.state = state
        self._granted = trio.Event()
        if state is TicketState.RUNNING:
            self._granted.set()

    def __repr__(self) -> str:
        return f"<Ticket {self.state.value}>"

    async def wait(self) -> None:
        """Wait until this ticket may run (returns at once if it already may)."""
        if self.state is TicketState.RELEASED:
            raise RuntimeError("can't wait on a released ticket")
        await self._granted.wait()

    def _grant(self) -> None:
        self.state = TicketState.RUNNING
        self._granted.set()

    def release(self) -> None:
        """Give the slot (or the place in line) back."""
        state, self.state = self.state, TicketState.RELEASED
        if state is TicketState.RUNNING:
            self._admission._slot_freed()
        elif state is TicketState.WAITING:
            self._admission._leave_line(self)


class Admission:
    """Bounded concurrency with a bounded FIFO line in front of it.

    Args:
        capacity: requests that run at once (the lane pool's capacity).
        max_queue: requests that may wait for a slot; beyond that `try_admit` refuses.
    """

    def __init__(self, capacity: int, max_queue: int) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be at least 1, got {capacity}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {max_queue}")
        self.capacity = capacity
        self.max_queue = max_queue
        self.running = 0
        self._line: collections.deque[Ticket] = collections.deque()
        self.rejected = 0

    def __repr__(self) -> str:
        return (
            f"<Admission capacity={self.capacity} running={self.running} "
            f"queued={self.queued}/{self.max_queue} rejected={self.rejected}>"
        )

    @property
    def queued(self) -> int:
        return len(self._line)

    def try_admit(self) -> Ticket | None:
        """Decide now: a running ticket, a waiting ticket, or None when the line is full."""
        if self.running < self.capacity and not self._line:
            self.running += 1
            return Ticket(self, TicketState.RUNNING)
        if len(self._line) < self.max_queue:
            ticket = Ticket(self, TicketState.WAITING)
            self._line.append(ticket)
            return ticket
        self.rejected += 1
        return None

    def _slot_freed(self) -> None:
        if self._line:
            self._line.popleft()._grant()  # the slot passes on; running stays the same
        else:
            self.running -= 1

    def _leave_line(self, ticket: Ticket) -> None:
        self._line.remove(ticket)
