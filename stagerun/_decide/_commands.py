"""What the speculation controller asks for and commands: the values between it and its shell.

`SpeculationController` (``_speculation``) asks the shell for drafts with a `DraftRequest`
and answers every step with `Command`s, which the Trio shell carries out in order.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import attrs

from ._windows import VerifyWindow

FinishReason: TypeAlias = Literal["eog", "length", "stop", "cancelled"]


@attrs.frozen
class DraftRequest:
    """What the drafter is asked for before the next window opens.

    Attributes:
        context: committed history plus the drafts of the live windows in flight.
        max_drafts: the most drafts the window may carry (0: a plain decode step).
        position: absolute position of the token the first draft guesses.
        starts_epoch: whether the window will start a new epoch.
        drafts: how many drafts to ask the drafter for (0: do not ask): ``max_drafts`` cut to
            the load share, 0 once drafting is switched off (`SpeculationPolicy.drafts_for`).
        room: the most drafts the tokens left to generate allow, whatever the window width:
            what drafts certain to be accepted (a grammar's forced tokens) may fill.
    """

    context: tuple[int, ...]
    max_drafts: int
    position: int
    starts_epoch: bool
    drafts: int
    room: int = 0


@attrs.frozen
class WindowTimings:
    """What a window cost stage 0, in milliseconds (used for stale windows' accounting).

    :meth:`SpeculationController.on_predictions` counts a stale window's round trip (from
    :meth:`~SpeculationController.open_window` to its reply) as its ``verify_elapsed_ms``
    unless one is given here (0 means not given), and the parts only the shell sees
    (draining, stage 0's compute, the write, the wait downstream) from these timings, 0
    without them. `stagerun._driver._speculative.SpeculativeDecode` measures every window.
    """

    drain_ms: float = 0.0
    stage0_compute_ms: float = 0.0
    forward_write_ms: float = 0.0
    downstream_wait_ms: float = 0.0
    verify_elapsed_ms: float = 0.0


@attrs.frozen
class SendWindow:
    """Compute ``window.inputs`` at ``window.base_position`` on stage 0 and send ``Verify``."""

    window: VerifyWindow


@attrs.frozen
class Commit:
    """Stream ``tokens`` to the client (the target's own; may end with an EOG token)."""

    window_id: int
    tokens: tuple[int, ...]


@attrs.frozen
class NewEpoch:
    """A divergence: ``Cancel`` the now stale windows; the next epoch restarts at a position."""

    stale_epoch: int
    epoch: int
    cancel_window_ids: tuple[int, ...]
    restart_position: int
    reason: str


@attrs.frozen
class Finish:
    """Generation is over: ``Cancel`` the windows made stale, then stop the request.

    ``pending_window_ids`` lists every window whose reply may still arrive; the shell drains
    them through :meth:`SpeculationController.on_predictions` and
    :meth:`~SpeculationController.on_cancelled` (until ``drained``) or gives up on them.
    """

    reason: FinishReason
    epoch: int
    cancel_window_ids: tuple[int, ...]
    pending_window_ids: tuple[int, ...]


Command: TypeAlias = SendWindow | Commit | NewEpoch | Finish
"""A step the Trio shell carries out, in the order the controller returned them."""
