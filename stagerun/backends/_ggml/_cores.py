"""The host's cores, shared by the ggml stages running on it (one lock per core), and each
backend's own pool of compute threads (`sleeping_pool`).

Theory of operation. ggml's compute threads wait for each other at every node of a graph by
spinning, so a graph on two threads stalls whenever one of them is not running, and a host
where other processes compute too has its cores taken in turn: three stage processes of two
threads each on a two-core host decoded 10 tokens/s with eight clients, against 116 with one
thread each. But one stream wants the opposite: its stages take turns, and the stage whose
turn it is has every core to itself (two threads each: 85 tokens/s against 62).

So a stage chooses per graph. Core ``i`` is byte ``i`` of one file per user (`cores_path`),
held with an open-file-description lock (``F_OFD_SETLK``) while a graph runs on it: the
kernel drops it when the holder closes the file or dies, and two backends of one process
(an in-process pipeline) exclude each other as two processes do. Before a graph,
`HostCores.taken` asks the kernel whether any other graph holds a core. If one does, or did
in the last `SETTLE_S`, the host is busy and the graph runs on one thread; if none did, it
takes every free core up to the stage's thread count and runs on as many threads. It never
waits: a graph that finds no free core runs on one thread without holding any.

The same file keeps when the host's latest graph ended (`ENDED_AT`, written after every graph):
a core that has had nothing to run for a while sleeps, and waking it is dear on a VM
(`GgmlBackend` then computes a small graph on one thread). Whether it sleeps is the host's
matter, not a stage's: three stages of one stream each wait two thirds of the time, while
the host computes throughout.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Final

__all__ = ["HostCores", "cores_path", "shares_cores", "sleeping_pool"]

log = logging.getLogger(__name__)

SETTLE_S: Final = 0.25
"""After it saw another graph on the host, a stage computes on one thread for this long."""
ENDED_AT: Final = 4096
"""Where in the lock file the end of the host's latest graph is kept (a float, monotonic s)."""
_ENDED: Final = struct.Struct("d")

# struct flock on Linux x86-64 and aarch64: l_type, l_whence, l_start, l_len, l_pid
_FLOCK: Final = struct.Struct("hhqqi4x")


@functools.cache
def shares_cores() -> bool:
    """Whether the ggml stages of this host share its cores (`HostCores` works here); if not,
    each stage had better be given its own share of them, as a fixed thread count."""
    cores = HostCores(1)
    try:
        return cores.shared
    finally:
        cores.close()


def cores_path() -> str:
    """This user's core-lock file: in /dev/shm (one per host), else the temporary directory."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"stagerun-cores-{os.getuid()}")


class HostCores:
    """Takes and gives back cores of the host for one backend's graphs.

    Args:
        cores: the cores to share out (this process's affinity).
        path: the lock file; None: `cores_path`. A file that another user owns is not used
            (nor is any file where locks are not supported): the backend then computes on
            its full thread count, as if alone.
    """

    def __init__(self, cores: int, path: str | None = None) -> None:
        self.cores = cores
        self._fd: int | None = None
        self._held: list[int] = []
        self._busy_until = 0.0
        self._ended = 0.0  # this backend's latest graph, where the host's is not known
        self._next = os.getpid() % max(1, cores)  # stages start their search apart
        path = cores_path() if path is None else path
        if not hasattr(fcntl, "F_OFD_SETLK"):  # Linux only
            log.warning("cores are not shared between stages: no OFD locks on this system")
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("cores are not shared between stages: cannot open %s (%s)", path, exc)
            return
        if os.fstat(fd).st_uid != os.getuid():
            os.close(fd)
            log.warning("cores are not shared between stages: %s belongs to another user", path)
            return
        self._fd = fd
        if self._try(0) is None:  # no OFD locks here (an old kernel, a strange filesystem)
            self.close()
            log.warning("cores are not shared between stages: %s takes no locks", path)
        else:
            self._release(0)

    @property
    def shared(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops every lock it held
            self._fd = None
            self._held = []

    @contextlib.contextmanager
    def taken(self, want: int) -> Iterator[int]:
        """Hold up to ``want`` cores while the block runs; yields how many threads to use."""
        if self._fd is None or want < 1:
            try:
                yield max(1, want)
            finally:
                self._ended = time.monotonic()
            return
        self._take(want)
        try:
            yield max(1, len(self._held))
        finally:
            for core in self._held:
                self._release(core)
            self._held = []
            self._ended = time.monotonic()
            if self._fd is not None:  # not closed meanwhile
                with contextlib.suppress(OSError):
                    os.pwrite(self._fd, _ENDED.pack(self._ended), ENDED_AT)

    def idle_for(self) -> float:
        """Seconds since the latest graph on the host ended (this backend's own where the
        host's is not known); a graph running now elsewhere is not counted."""
        now = time.monotonic()
        ended = self._ended
        if self._fd is not None:
            with contextlib.suppress(OSError, struct.error):
                (host,) = _ENDED.unpack(os.pread(self._fd, _ENDED.size, ENDED_AT))
                if 0.0 <= host <= now:  # not a torn or foreign value
                    ended = max(ended, host)
        return now - ended

    def _take(self, want: int) -> None:
        now = time.monotonic()
        if self._others_compute():
            self._busy_until = now + SETTLE_S
        if now < self._busy_until:
            want = 1
        for step in range(self.cores):
            core = (self._next + step) % self.cores
            if self._try(core):
                self._held.append(core)
                if len(self._held) == want:
                    return

    def _others_compute(self) -> bool:
        """Whether another graph holds one of the cores (one question to the kernel)."""
        assert self._fd is not None
        asked = _FLOCK.pack(fcntl.F_WRLCK, 0, 0, self.cores, 0)
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, asked)
        return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)

    def _try(self, core: int) -> bool | None:
        """Lock ``core``: True if taken, False if someone holds it, None if locks fail here."""
        assert self._fd is not None
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, core, 1, 0))
        except (BlockingIOError, PermissionError):
            return False
        except OSError:
            return None
        return True

    def _release(self, core: int) -> None:
        assert self._fd is not None
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, 0, core, 1, 0))


def sleeping_pool(ffi: Any, lib: Any, threads: int) -> Any:
    """A pool of ``threads`` compute threads that sleep between graphs; NULL for one thread.

    Without a pool of its own, ggml starts fresh threads for every graph, which poll for work
    at the default level: measured with three stage processes sharing two cores, one stream
    decoded 22 tokens/s with two threads per stage against 62 with one, the waiting threads
    taking the cores from the stage that computes. Sleeping (``poll`` 0) between graphs gave
    86 with two, and one stage went from 90 to 105 (the threads are started once).
    """
    if threads <= 1:
        return ffi.NULL
    params = ffi.new("struct ggml_threadpool_params *", lib.ggml_threadpool_params_default(threads))
    params.poll = 0
    pool = lib.ggml_threadpool_new(params)
    if pool == ffi.NULL:
        raise MemoryError(f"ggml could not start a pool of {threads} threads")
    return pool
