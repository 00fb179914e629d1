"""The policies a pipeline holds: how it speculates, recovers a request and supervises its
stage processes (`SpeculationConfig`, `RecoveryPolicy`, `SupervisionPolicy`).

They are settings types like `stagerun._driver._config.PipelineConfig`, which holds one of each
and re-exports them; `stagerun.plan` checks them with the rest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs

from .. import _decide, plugins

# A stage process that exits this often is given up (systemd's StartLimitBurst is 5 too): with
# the 0.2 s backoff doubling, five quick failures take about 10 s of trying, long enough to
# ride out a transient cause, short enough that clients are told soon.
DEFAULT_MAX_FAILURES = 5
DEFAULT_FAILURE_WINDOW = 60.0  # seconds; exits older than this are forgotten
DEFAULT_RECHECK_INTERVAL = 2.0  # seconds between port checks of a given-up stage


@attrs.frozen
class SpeculationConfig:
    """How a pipeline speculates.

    Attributes:
        drafter: ``off``, or a drafter plugin: ``ngram`` (prompt lookup), ``draft-model``, or
            an installed plugin's name.
        depth: verify windows kept in flight per request (1 = serial).
        window: draft tokens per window at most.
        adaptive: let the window width follow acceptance, and stop drafting for a request
            whose acceptance is too low to pay for the windows.
        draft_model: the GGUF (name or path) for ``draft-model``.
        forced: a request with a grammar drafts the tokens its grammar forces (and has its
            other drafts cut where the grammar refuses them), speculating for that even with
            ``drafter`` off; False leaves its decoding as for any request.
    """

    drafter: str = "off"
    depth: int = 4
    window: int = 4
    adaptive: bool = True
    draft_model: str | None = None
    forced: bool = True

    def __attrs_post_init__(self) -> None:
        if self.drafter != "off" and self.drafter not in plugins.names("drafters"):
            choices = ", ".join(["off", *plugins.names("drafters")])
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {choices}")
        if not 1 <= self.depth <= _decide.MAX_VERIFY_WINDOW_DEPTH:
            raise ValueError(
                f"depth must be within 1..{_decide.MAX_VERIFY_WINDOW_DEPTH}, got {self.depth}"
            )
        if not 1 <= self.window <= 32:
            raise ValueError(f"window must be within 1..32 draft tokens, got {self.window}")
        if self.drafter == "draft-model" and not self.draft_model:
            raise ValueError("the draft-model drafter needs a draft model (--draft-model)")

    @property
    def enabled(self) -> bool:
        return self.drafter != "off"


@attrs.frozen
class RecoveryPolicy:
    """How a request survives a lane that breaks under it (see docs/reliability.md).

    When a lane fails mid-request (a stage killed, a connection reset, a reply timeout), stage
    0 waits ``backoff`` seconds (doubling up to ``max_backoff``), checks out a fresh lane --
    which reaches the restarted stage -- and replays the committed tokens (prompt plus
    everything already generated) as a prefill to rebuild every KV cache; decoding then goes
    on where it stopped, and the caller sees one uninterrupted stream. Sampling depends only
    on the seed and the position, so the continuation is the one the request would have had.

    Args:
        max_breaks: lane failures one request survives; the next one fails it.
        timeout: seconds one recovery may take (waiting for the stage included) before the
            request fails with `RecoveryFailedError`. Default
            ``$STAGERUN_RECOVERY_TIMEOUT_SECS`` or 60.
        backoff: first wait between attempts, in seconds.
        max_backoff: the longest wait between attempts.
    """

    max_breaks: int = 3
    timeout: float = attrs.field(
        factory=lambda: float(os.environ.get("STAGERUN_RECOVERY_TIMEOUT_SECS", "60"))
    )
    backoff: float = 0.1
    max_backoff: float = 0.5

    @classmethod
    def disabled(cls) -> RecoveryPolicy:
        """Fail a request at its first lane failure."""
        return cls(max_breaks=0)


@attrs.frozen
class SupervisionPolicy:
    """How `open_pipeline` looks after the stage processes it starts.

    Args:
        restart: start a stage again when its process exits.
        backoff: first wait before a restart, in seconds; doubles up to ``max_backoff``.
        stable_after: a process that ran this long resets the backoff.
        probe_interval: seconds between liveness probes (0 turns probing off).
        probe_timeout: a probe's handshake deadline.
        probe_failures: failed probes in a row before a live process is killed.
        ready_timeout: seconds a (re)started process has to print its ready line.
        max_failures: exits within ``failure_window`` seconds after which the stage is
            given up (state ``failed``): it is not started again, and requests that need it
            fail at once instead of waiting for a recovery that cannot come.
        failure_window: the window, in seconds, ``max_failures`` is counted over.
        recheck_interval: while a stage is given up, seconds between checks that its port
            can be bound again (another process held it, or a stuck one is gone); when it
            can, the stage is started once more. Each revival that fails doubles the wait, up
            to ``failure_window``. 0 never starts a given-up stage again.
    """

    restart: bool = True
    backoff: float = 0.2
    max_backoff: float = 10.0
    stable_after: float = 30.0
    probe_interval: float = 2.0
    probe_timeout: float = 5.0
    probe_failures: int = 3
    ready_timeout: float = 120.0
    max_failures: int = DEFAULT_MAX_FAILURES
    failure_window: float = DEFAULT_FAILURE_WINDOW
    recheck_interval: float = DEFAULT_RECHECK_INTERVAL

    def __attrs_post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be at least 1, got {self.max_failures}")
        if not self.failure_window > 0:
            raise ValueError(f"failure_window must be positive, got {self.failure_window}")
        if not self.recheck_interval >= 0:
            raise ValueError(f"recheck_interval must be 0 or more, got {self.recheck_interval}")

    def gives_up(self, exits: Sequence[float]) -> bool:
        """Whether a stage whose process exited at the times ``exits`` (oldest first, the
        latest exit last) is given up rather than restarted.

        True once ``max_failures`` of them fall within ``failure_window`` seconds up to the
        latest: the doubling backoff alone would restart a stage that cannot start (its port
        taken, its model file gone) forever, every ``max_backoff`` seconds.
        """
        if not exits:
            return False
        since = exits[-1] - self.failure_window
        return sum(1 for t in exits if t > since) >= self.max_failures

    def restart_delay(self, previous: float | None, uptime: float) -> float:
        """Seconds to wait before restarting a process that exited after ``uptime`` seconds.

        Args:
            previous: the wait before the previous restart; None if this is the first one.
            uptime: how long the process that just exited served: from its ready line to its
                exit (0 when it never got ready, so a start that hangs until it is killed
                never counts as a stable run).

        Returns:
            ``backoff`` for the first restart and after a run longer than ``stable_after``;
            otherwise twice ``previous``, at most ``max_backoff``.
        """
        if previous is None or uptime > self.stable_after:
            return self.backoff
        return min(previous * 2, self.max_backoff)

    def recheck_delay(self, revivals: int) -> float:
        """Seconds between port checks of a given-up stage after ``revivals`` failed revivals:
        ``recheck_interval`` doubled each time, at most ``failure_window`` (a stage whose
        cause is not its port, a model file gone, is then tried once a window)."""
        return min(self.recheck_interval * 2.0 ** min(revivals, 32), self.failure_window)
