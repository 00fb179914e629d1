"""Small helpers shared by the Trio shell."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def single_exceptions() -> Iterator[None]:
    """Re-raise a nursery's ExceptionGroup of exactly one exception as that exception.

    A user who leaves ``async with open_pipeline(...)`` with a ValueError should see the
    ValueError, not a group wrapping it; groups of several errors stay groups.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if inner is group:
            raise
        raise inner from None
