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


def only_of(
    group: BaseExceptionGroup[BaseException], kinds: tuple[type[BaseException], ...]
) -> BaseException | None:
    """The first leaf of ``group`` if every leaf is one of ``kinds``, else None.

    Two tasks of one nursery often fail from the same cause (a lane's reader and writer both
    see the broken connection): the group then stands for that one failure.
    """
    leaves: list[BaseException] = []
    todo: list[BaseException] = [group]
    while todo:
        current = todo.pop()
        if isinstance(current, BaseExceptionGroup):
            todo.extend(reversed(current.exceptions))
        else:
            leaves.append(current)
    if leaves and all(isinstance(leaf, kinds) for leaf in leaves):
        return leaves[0]
    return None


@contextmanager
def one_failure(kinds: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Re-raise a group whose leaves are all ``kinds`` as its first leaf (see `only_of`)."""
    try:
        yield
    except BaseExceptionGroup as group:
        failure = only_of(group, kinds)
        if failure is None:
            raise
        raise failure from group
