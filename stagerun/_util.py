"""Small helpers shared by the Trio shell."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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
    matched, rest = group.split(kinds)
    if matched is None or rest is not None:
        return None
    return first_leaf(matched)  # split keeps the leaves in order


def first_leaf(exc: BaseException) -> BaseException:
    """``exc`` itself, or the first exception that is no group, in ``exc``'s order."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]  # no group is empty
    return exc


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


_libc: Any = None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``; else nothing).

    numpy's large temporaries and the KV caches of ended sessions are freed into glibc's
    heaps, which keep the pages: under a stream of requests a stage's resident memory grows
    by tens of MiB. Trimming returns them. It walks the heaps, so callers rate-limit it.
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time process ``pid`` has used (Linux ``/proc``; None if unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # after the name, which may hold spaces or ")"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# Open files a stagerun process keeps for itself besides its connections: the model file, logs,
# pipes to stage processes, the event loop (measured: 51 for serve with three local stages).
FD_RESERVE = 64


def raise_open_file_limit() -> int | None:
    """Raise this process's soft limit on open files to its hard limit; return the soft limit.

    Every connection a stage holds is an open file, and the usual soft limit (often 1024) is
    far below the hard one. None where there is no such limit (no ``resource`` module); where
    the limit cannot be raised, the soft limit stays as it was and is returned.
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):  # a sandbox may refuse: keep the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def default_threads(stages_on_host: int = 1) -> int:
    """Compute threads for one of ``stages_on_host`` stages sharing this host's cores.

    The cores are the ones this process may run on (its affinity), shared out evenly, at
    least one each.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, stages_on_host))
