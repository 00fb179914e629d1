"""Whether a child process is still alive, read from /proc."""

from __future__ import annotations

import os


def running(pid: int) -> bool:
    """True until ``pid`` has exited for good: once False, its sockets are closed.

    A zombie has exited only when all its threads have: after SIGKILL the main thread can turn
    zombie while other threads (BLAS, Trio's worker threads) are still being torn down, and the
    process's sockets stay open (a listening one still completes handshakes) until they are.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1
    except FileNotFoundError:
        return False
