"""A child of a stagerun supervisor exits as soon as its supervisor is gone, however it died.

Theory of operation: `stagerun._driver._supervise.spawn_process` gives each child the read end
of a pipe as its stdin and keeps the only write end; the kernel closes that end when the
supervisor dies, even by SIGKILL, and the child then reads end-of-file. `exit_with_parent`
waits for that on a daemon thread and ends the process with `os._exit`.

This module imports nothing but the standard library, and ``import stagerun`` imports it first,
which starts the watch (when the environment asks for it):
a child killed while it still imports numpy, the model code and its plugins (half a second
on a loaded 2-core machine) is gone within milliseconds of its parent, not after its imports.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Mapping

#: Set (to "1") in a child's environment by `spawn_process`: exit when stdin reaches EOF.
EXIT_WITH_PARENT_ENV = "STAGERUN_EXIT_WITH_PARENT"
#: A file the parent would have removed at its end (the lane secret it made for its stages):
#: a child that outlives the parent removes it as it exits.
REMOVE_WITH_PARENT_ENV = "STAGERUN_REMOVE_WITH_PARENT"
# The exit status of a stage whose parent is gone (nobody is left to read it: any failure code).
ORPHANED_EXIT_CODE = 1

_watching = threading.Lock()  # held for good once the watch thread runs (it runs once)


def exit_with_parent(environ: Mapping[str, str] | None = None) -> None:
    """In a child of `spawn_process`: exit at once when the supervising process is gone.

    Does nothing unless ``$STAGERUN_EXIT_WITH_PARENT`` is ``1`` (a ``stagerun stage`` started
    by hand keeps whatever stdin it was given), nor a second time. The wait runs on a daemon
    thread rather than a Trio task because it must work while the event loop is busy or not
    yet running (a stage imports and loads its model before it serves). Nothing is left to
    stop gracefully once the parent is gone (stage 0 was in it, and the other stages it
    started go too), so it ends the process with `os._exit`.
    """
    env = os.environ if environ is None else environ
    if env.get(EXIT_WITH_PARENT_ENV) != "1" or not _watching.acquire(blocking=False):
        return
    watch = threading.Thread(target=_exit_at_eof, args=(0,), name="exit-with-parent", daemon=True)
    watch.start()


def _exit_at_eof(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass  # the parent never writes; anything read is ignored
    except OSError as exc:
        # (no logging here: this runs before anything is configured, and must import little)
        print(f"stagerun: cannot watch for the parent's exit on fd {fd} ({exc})", file=sys.stderr)
        return
    leftover = os.environ.get(REMOVE_WITH_PARENT_ENV)
    if leftover:
        with contextlib.suppress(OSError):  # a sibling stage may have removed it first
            os.unlink(leftover)
    os._exit(ORPHANED_EXIT_CODE)


exit_with_parent()  # at import: see the module's docstring
