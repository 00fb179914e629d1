"""`RecentWork`: what a stage computed lately, kept for the web page's live timeline.

Theory of operation: every compute a stage's engine finishes (or stops, for a stale verify
window) is one entry in a ring of the last `RING` of them, whatever request it was for:
when it ran on the stage's own monotonic clock (``time.perf_counter_ns``, one clock for every
process of a host), the request and window, whether the work was wasted, and how many
forwards its tick computed together. A stage answers a ``Probe`` that names a request with
that request's entries (`of`), at most `MAX_SPANS` of the latest, flattened for the wire
(`_proto.Status.spans`); stage 0 maps them onto its own clock and draws them.

Recording is one tuple appended to a bounded deque per compute, whoever watches: nothing
else is kept, nothing is sent until someone probes.

Processes that share a clock say so: `clock_id` names the clock (on Linux, the boot's id,
under which every process reads the same ``CLOCK_MONOTONIC``), and stage 0 takes the spans
of a stage with its own clock id as they are, with no estimate of the offset.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from pathlib import Path
from typing import Final

from .._proto import MAX_STATUS_SPANS, SPAN_COMPUTE, SPAN_FIELDS, SPAN_STALE

__all__ = ["MAX_SPANS", "RING", "RecentWork", "clock_id"]

#: Computes the ring remembers, over every request.
RING: Final = 2048
#: Entries one request's answer carries at most (the latest).
MAX_SPANS: Final = MAX_STATUS_SPANS


@functools.cache
def clock_id() -> int:
    """A number naming this host's monotonic clock since it booted (0: not known here)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()
    except OSError:
        return 0
    return int.from_bytes(hashlib.blake2b(boot, digest_size=8).digest()) >> 2 or 1


class RecentWork:
    """The last `RING` computes of one stage (see the module docstring)."""

    def __init__(self, size: int = RING) -> None:
        # (request id, start ns, end ns, window id, kind, batch)
        self._ring: collections.deque[tuple[int, int, int, int, int, int]] = collections.deque(
            maxlen=size
        )

    def __repr__(self) -> str:
        return f"<RecentWork held={len(self._ring)} of {self._ring.maxlen}>"

    def __len__(self) -> int:
        return len(self._ring)

    def computed(
        self, request_id: int, start_ns: int, end_ns: int, window_id: int, batch: int
    ) -> None:
        """A compute for ``request_id`` ran from ``start_ns`` to ``end_ns`` in a tick of
        ``batch`` forwards (``window_id`` 0 for anything but a verify window)."""
        self._ring.append(
            (request_id, start_ns, max(start_ns, end_ns), window_id, SPAN_COMPUTE, batch)
        )

    def stopped(self, request_id: int, start_ns: int, end_ns: int, window_id: int) -> None:
        """A stale verify window's compute, stopped (or dropped) between these times."""
        self._ring.append((request_id, start_ns, max(start_ns, end_ns), window_id, SPAN_STALE, 0))

    def of(self, request_id: int, limit: int = MAX_SPANS) -> tuple[int, ...]:
        """The latest ``limit`` entries of ``request_id``, oldest first, flattened
        `SPAN_FIELDS` ints each: start ns, end ns, window id, kind, batch."""
        if request_id == 0:
            return ()
        picked: list[tuple[int, int, int, int, int, int]] = []
        for entry in reversed(self._ring):
            if entry[0] == request_id:
                picked.append(entry)
                if len(picked) == limit:
                    break
        flat: list[int] = []
        for entry in reversed(picked):
            flat.extend(entry[1:])
        assert len(flat) == SPAN_FIELDS * len(picked)
        return tuple(flat)
