"""What every conformance suite shares: named checks, deadlines, failure messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import attrs
import trio
import trio.testing

from ..._util import first_leaf

_RECEIVE_SIZE = 1 << 18  # what stagerun's lanes ask receive_some for


# --- shared machinery -------------------------------------------------------------------------


def _first_assertion(exc: BaseException) -> AssertionError | None:
    """``exc`` if it is an AssertionError, else the first one in its group (in order)."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc if isinstance(exc, AssertionError) else None
    assertions, _ = exc.split(AssertionError)
    if assertions is None:
        return None
    found = first_leaf(assertions)  # split keeps the leaves in order
    assert isinstance(found, AssertionError), found
    return found


@attrs.define
class _Check:
    """One named check in progress; ``progress`` says how far it got (for a hang)."""

    suite: str
    name: str
    progress: str = ""

    def fail(self, detail: str) -> NoReturn:
        raise AssertionError(f"{self.suite}: {self.name}: {detail}")


@contextlib.contextmanager
def _checking(suite: str, name: str, timeout: float | None = None) -> Iterator[_Check]:
    """Run a check; anything but an AssertionError becomes one that names the check."""
    check = _Check(suite, name)
    try:
        if timeout is None:
            yield check
        else:
            with trio.fail_after(timeout):
                yield check
    except trio.TooSlowError as exc:
        so_far = f" ({check.progress})" if check.progress else ""
        check_failed = AssertionError(
            f"{suite}: {name}: did not finish within {timeout:g}s{so_far}"
        )
        raise check_failed from exc
    except BaseException as exc:
        found = _first_assertion(exc)
        if found is not None:
            if found is exc:
                raise
            raise found from None
        if not isinstance(exc, Exception):
            raise
        leaf = first_leaf(exc)
        raise AssertionError(f"{suite}: {name}: raised {type(leaf).__name__}: {leaf}") from exc


# --- transports -------------------------------------------------------------------------------
