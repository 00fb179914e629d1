"""stagerun lanes over Unix-domain sockets: stages on one machine, no TCP stack, no ports.

An example third-party transport plugin. It is registered through an entry point of this
distribution (see pyproject.toml), exactly like stagerun's own ``tcp`` and ``ws``::

    [project.entry-points."stagerun.transports"]
    unix = "stagerun_unix:UnixTransport"

Addresses are ``unix:///ABSOLUTE/PATH.sock``. A Unix socket is a byte stream, like TCP, so
the streams are trio's own `trio.SocketStream`: stagerun's frames pass through unchanged, reads
are cancel-safe, and idle pooled lanes are probed through their ``socket`` attribute.

Theory of operation: ``serve`` binds a listening socket at the path and serves it with
`trio.serve_listeners`. A socket file left behind by a server that died is removed first, but
only after a connection attempt to it is refused; a live server's socket, or any other kind of
file, is never touched. On the way out ``serve`` unlinks its socket file, unless another server
has replaced it in the meantime.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import stat
import struct
import tempfile
from functools import partial
from typing import ClassVar

import trio

from stagerun import LaneHandshakeError
from stagerun.abc import ConnectionHandler, Transport

__all__ = ["UnixTransport", "parse_unix_address"]
__version__ = "0.1.0"

_SCHEME = "unix"
_BACKLOG = 128
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def parse_unix_address(address: str) -> str:
    """Return the socket path of ``unix:///ABSOLUTE/PATH``.

    Raises:
        ValueError: not a ``unix://`` address, or the path is not absolute.
    """
    scheme, sep, path = address.partition("://")
    if not sep or scheme != _SCHEME or not path.startswith("/"):
        raise ValueError(
            f"unix socket address {address!r} must look like unix:///ABSOLUTE/PATH.sock"
        )
    return path


def _peer_name(stream: trio.SocketStream, path: str) -> str:
    """``unix://PATH (pid N)``: a client of a Unix socket has no address, but it has a pid."""
    if hasattr(socket, "SO_PEERCRED"):
        try:
            creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        except OSError:
            pass
        else:
            pid, _uid, _gid = _UCRED.unpack(creds)
            if pid > 0:
                return f"unix://{path} (pid {pid})"
    return f"unix://{path}"


async def _remove_stale_socket(path: str) -> None:
    """Unlink a socket file at ``path`` that nobody listens on any more.

    Raises:
        OSError: ``path`` is a live server's socket, or a file that is not a socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; not replacing it")
    probe = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with trio.move_on_after(1):
            await probe.connect(path)
            raise OSError(errno.EADDRINUSE, f"a server is already listening on {path}")
    except ConnectionRefusedError:
        os.unlink(path)  # stale: its server is gone
    finally:
        probe.close()


class UnixTransport(Transport):
    """Lanes over Unix-domain sockets: ``unix:///ABSOLUTE/PATH.sock``."""

    schemes: ClassVar[tuple[str, ...]] = (_SCHEME,)
    _names: ClassVar[itertools.count[int]] = itertools.count(1)

    def __repr__(self) -> str:
        return "<UnixTransport>"

    def check_address(self, address: str) -> None:
        parse_unix_address(address)

    def local_address(self, host: str) -> str:
        """A fresh socket path in the temporary folder (there is no host or port)."""
        name = f"stagerun-{os.getpid()}-{next(self._names)}.sock"
        return f"{_SCHEME}://{os.path.join(tempfile.gettempdir(), name)}"

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        """Connect to the socket at ``address``'s path within ``timeout`` seconds.

        Raises:
            LaneHandshakeError: no socket there, nobody listening, or no answer in time.
        """
        path = parse_unix_address(address)
        try:
            with trio.fail_after(timeout):
                return await trio.open_unix_socket(path)
        except trio.TooSlowError as exc:
            raise LaneHandshakeError(f"could not connect to {address} within {timeout:g}s") from exc
        except FileNotFoundError as exc:
            raise LaneHandshakeError(
                f"could not connect to {address}: no socket file there (is the stage running?)"
            ) from exc
        except OSError as exc:
            raise LaneHandshakeError(
                f"could not connect to {address}: {exc.strerror or exc}"
            ) from exc

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen at ``address``'s path until cancelled; each connection runs ``handler``.

        Raises:
            OSError: the path is taken by a live server or by a file that is not a socket,
                or the socket cannot be bound there.
        """
        path = parse_unix_address(address)
        await _remove_stale_socket(path)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(path)
            created = os.lstat(path)
            sock.listen(_BACKLOG)
        except BaseException:
            sock.close()
            raise
        listener = trio.SocketListener(sock)

        async def handle(stream: trio.SocketStream) -> None:
            await handler(stream, _peer_name(stream, path))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(trio.serve_listeners, handle, [listener]))
                task_status.started(f"{_SCHEME}://{path}")
        finally:
            sock.close()
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                pass
            else:
                # Leave a socket alone that another server bound after ours was removed.
                if (now.st_dev, now.st_ino) == (created.st_dev, created.st_ino):
                    os.unlink(path)
