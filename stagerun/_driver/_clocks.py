"""`StageClocks`: where each stage's monotonic clock stands against stage 0's.

Theory of operation: a stage's `_proto.Status` carries its clock (``clock_ns``), read some
time between the moment stage 0 sent the ``Probe`` and the moment the answer came back, so
the offset to add to the stage's readings lies in ``[asked - clock, answered - clock]``. Each
probe's interval is intersected with what earlier probes of that address left: the estimate
narrows to the best round trip seen (a probe slowed by a busy loop widens nothing), and its
middle is the offset used. An interval that misses the kept one means the kept one is wrong
(the address now answers from another host, or the clocks drifted apart): it is replaced.
A stage that says it reads stage 0's own clock (`_proto.Status.clock_id`: the same host,
the same boot) needs no estimate: its offset is 0.
"""

from __future__ import annotations

from .._engine._recent import clock_id as own_clock_id

__all__ = ["StageClocks"]


class StageClocks:
    """The offset of each probed address's clock (see the module docstring)."""

    def __init__(self) -> None:
        self._bounds: dict[str, tuple[int, int]] = {}

    def __repr__(self) -> str:
        widths = {a: hi - lo for a, (lo, hi) in self._bounds.items()}
        return f"<StageClocks uncertainty_ns={widths}>"

    def offset(
        self, address: str, asked_ns: int, clock_ns: int, answered_ns: int, clock_id: int = 0
    ) -> int:
        """What to add to ``address``'s clock readings to put them on stage 0's, after a
        probe sent at ``asked_ns`` and answered at ``answered_ns`` (stage 0's clock) that
        read ``clock_ns`` on the clock ``clock_id`` there."""
        if clock_id and clock_id == own_clock_id():
            return 0
        lo, hi = asked_ns - clock_ns, max(asked_ns, answered_ns) - clock_ns
        kept = self._bounds.get(address)
        if kept is not None and kept[0] <= hi and lo <= kept[1]:
            lo, hi = max(lo, kept[0]), min(hi, kept[1])
        self._bounds[address] = (lo, hi)
        return (lo + hi) // 2
