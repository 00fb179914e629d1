"""What the sessions of every lane on a stage may hold together: how many, and their KV.

A backend grows a session's cache as positions are computed (up to the model's context; a
``Trim`` gives no memory back), so a session is charged for the furthest position it ever
reached, until it ends. The stage's prefix cache (`stagerun._engine._prefix`) holds KV
positions from the same budget, and gives them back whenever a session needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._engine._config import DEFAULT_MAX_KV_TOKENS as DEFAULT_MAX_KV_TOKENS
from .._engine._config import DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS

__all__ = ["DEFAULT_MAX_KV_TOKENS", "DEFAULT_MAX_SESSIONS", "Charged", "SessionBudget"]


class Charged(Protocol):
    """A session as the budget sees it (`stagerun._engine._session.Session`)."""

    kv_positions: int


class SessionBudget:
    """What the sessions of all lanes on one stage may hold together.

    Decide, then do: `open` and `grow` either count what was asked for and return None, or
    count nothing and return the reason, which the lane sends back as an ``Error``.

    Args:
        max_sessions: sessions open at once on the stage, over all its lanes.
        max_kv_tokens: KV positions all those sessions' caches may reach together.
    """

    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        if max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be at least 1, got {max_kv_tokens}")
        self.max_sessions = max_sessions
        self.max_kv_tokens = max_kv_tokens
        self.sessions = 0
        self.kv_tokens = 0
        self.cached_tokens = 0  # held by the prefix cache, which gives them back on demand
        self.reclaim: Callable[[int], int] | None = None  # evicts cached positions: the freed

    def __repr__(self) -> str:
        return (
            f"<SessionBudget sessions={self.sessions}/{self.max_sessions} "
            f"kv_tokens={self.kv_tokens}/{self.max_kv_tokens}>"
        )

    def open(self) -> str | None:
        """Count one more session, or say why the stage takes no more."""
        if self.sessions >= self.max_sessions:
            return (
                f"this stage already holds {self.sessions} sessions, its limit "
                f"(max_sessions={self.max_sessions}); run fewer requests at once or raise it"
            )
        self.sessions += 1
        return None

    def grow(self, session: Charged, end: int) -> str | None:
        """Charge ``session`` for KV positions up to ``end``, or say why there is no room."""
        extra = end - session.kv_positions
        if extra <= 0:
            return None
        over = self.kv_tokens + self.cached_tokens + extra - self.max_kv_tokens
        if over > 0 and self.reclaim is not None:
            self.reclaim(over)  # running requests win over cached prefixes
        if self.kv_tokens + self.cached_tokens + extra > self.max_kv_tokens:
            return (
                f"this stage's sessions already hold {self.kv_tokens} KV positions; {extra} more "
                f"would pass its limit (max_kv_tokens={self.max_kv_tokens}); run fewer or "
                "shorter requests at once or raise it"
            )
        self.kv_tokens += extra
        session.kv_positions = end
        return None

    def hold_cached(self, positions: int) -> bool:
        """Count ``positions`` held by the prefix cache, if they fit beside the sessions'."""
        if self.kv_tokens + self.cached_tokens + positions > self.max_kv_tokens:
            return False
        self.cached_tokens += positions
        return True

    def release_cached(self, positions: int) -> None:
        """The prefix cache let go of ``positions``."""
        self.cached_tokens -= positions

    def close(self, session: Charged) -> None:
        """Give back what ``session`` held (it has ended)."""
        self.sessions -= 1
        self.kv_tokens -= session.kv_positions
        session.kv_positions = 0
