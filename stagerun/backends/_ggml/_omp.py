"""One thread for every graph of the process, where ggml's threads are OpenMP's.

A ggml built with OpenMP (llama.cpp's default) runs a graph's threads as an OpenMP team of
the thread that calls it. Measured with llama.cpp's build here: the first thread of a process
to compute gets its two threads' worth (a 16-row SmolLM2 step in 80 ms), and every other
thread that computes afterwards about one (175 ms of wall time, 122 of its own CPU): a stage
whose ticks run now on its event loop, now in a worker thread, computed at half speed. So
with such a build every graph of the process is computed on one long-lived thread
(`on_compute_thread`), whichever thread asks; with the wheel's ggml (ggml's own thread pool,
no OpenMP) the caller computes itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["on_compute_thread"]

T = TypeVar("T")

_jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()


def on_compute_thread(openmp: bool, work: Callable[[], T]) -> T:
    """``work()``, on the process's compute thread if ``openmp``, else on this thread.

    The caller waits for it (an exception it raises is raised here). Work already on the
    compute thread runs at once.
    """
    if not openmp or threading.current_thread() is _thread:
        return work()
    box: list[Any] = []
    done = threading.Event()
    _queue().put((work, box, done))
    done.wait()
    outcome, failed = box
    if failed:
        raise outcome
    return outcome  # type: ignore[no-any-return]


def _queue() -> queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]]:
    global _jobs, _thread
    with _lock:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            _thread = threading.Thread(
                target=_serve, args=(_jobs,), name="stagerun-ggml-compute", daemon=True
            )
            _thread.start()
        return _jobs


def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]]) -> None:
    while True:
        work, box, done = jobs.get()
        try:
            box[:] = [work(), False]
        except BaseException as exc:  # handed to the caller, which raises it
            box[:] = [exc, True]
        finally:
            done.set()
        del work, box, done  # the next job's wait must not keep this one's outputs alive
