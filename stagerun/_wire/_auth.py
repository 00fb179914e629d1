"""Where the shared lane secret comes from.

Every process of a pipeline that should authenticate its lanes is given the same secret, by
file (``$STAGERUN_SECRET_FILE``, or ``--secret-file`` on the command line, which sets it for
the stage processes started from there) or, less safely, by value (``$STAGERUN_SECRET``:
environments leak into process listings and crash reports). With a secret, a stage refuses any
connection that does not prove it holds the same one, and a connecting stage refuses a peer
that cannot prove it either (see `stagerun._proto` for the handshake).

A secret file is treated like an ssh key: it must belong to this user and be private (mode
``600``), or it is refused. A process reads it once and again only when it changes, not on
every lane it dials.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import sys
from collections.abc import Mapping

SECRET_FILE_ENV = "STAGERUN_SECRET_FILE"
SECRET_ENV = "STAGERUN_SECRET"
MIN_SECRET_BYTES = 16
# A secret is a few dozen bytes; a bigger file (or /dev/zero) is a mistake, not a key.
MAX_SECRET_FILE_BYTES = 64 << 10


def lane_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The lane secret of this process, or None when lanes are not authenticated.

    A file's contents are used as they are, less one trailing newline. The file must be this
    user's and private (like an ssh key: ``chmod 600``); it is read once, and read again only
    after it changes (a new inode, size or modification time), so dialling a lane costs one
    ``stat``.

    Raises:
        ValueError: the file cannot be read, is not private to this user, is larger than
            64 KiB, or the secret is shorter than 16 bytes.
    """
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV)
    if path:
        secret = _read_secret_file(path).removesuffix(b"\n").removesuffix(b"\r")
        where = f"the lane secret file {path}"
    elif env.get(SECRET_ENV):
        secret = env[SECRET_ENV].encode()
        where = f"${SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where} holds {len(secret)} bytes; a lane secret needs at least "
            f"{MIN_SECRET_BYTES} (try: umask 077; head -c 32 /dev/urandom | base64 > FILE)"
        )
    return secret


# path -> (what the file was when it was read: device, inode, size, mtime), its contents
_read_files: dict[str, tuple[tuple[int, int, int, int], bytes]] = {}


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _read_secret_file(path: str) -> bytes:
    cached = _read_files.get(path)
    if cached is not None:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ValueError(f"cannot read the lane secret file {path} ({exc.strerror})") from None
        check_private(path, st, "the lane secret file")  # a chmod after the first read counts
        if _identity(st) == cached[0]:
            return cached[1]
    st, data = read_private_file(path, "the lane secret file", MAX_SECRET_FILE_BYTES)
    _read_files[path] = (_identity(st), data)
    return data


def read_private_file(path: str, what: str, max_bytes: int) -> tuple[os.stat_result, bytes]:
    """Read a file holding a secret (``what`` names it in errors), at most ``max_bytes``.

    The file must be private, as ssh wants of keys: owned by this user, and neither readable
    nor writable by anyone else. It is checked on the open file, so the file read is the file
    checked.

    Raises:
        ValueError: the file cannot be read, is not private, or is larger than ``max_bytes``.
    """
    try:
        with open(path, "rb") as file:
            st = os.fstat(file.fileno())
            check_private(path, st, what)
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path} ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise ValueError(
            f"{what} {path} holds more than {max_bytes} bytes; a secret is a few dozen "
            "(head -c 32 /dev/urandom | base64)"
        )
    return st, data


def check_private(path: str, st: os.stat_result, what: str) -> None:
    """Refuse a secret file that other users could read or change (ssh does so for keys)."""
    if sys.platform == "win32":  # no POSIX modes or owners to check
        return
    if st.st_mode & 0o077:
        raise ValueError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}, so other "
            f"users can read or change it; make it private: chmod 600 {path}"
        )
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}); give each user its own copy (chown, then chmod 600)"
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
