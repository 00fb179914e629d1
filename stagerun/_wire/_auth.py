"""Where the shared lane secret comes from.

Every process of a pipeline that should authenticate its lanes is given the same secret, by
file (``$STAGERUN_SECRET_FILE``, or ``--secret-file`` on the command line, which sets it for
the stage processes started from there) or, less safely, by value (``$STAGERUN_SECRET``:
environments leak into process listings and crash reports). With a secret, a stage refuses any
connection that does not prove it holds the same one, and a connecting stage refuses a peer
that cannot prove it either (see `stagerun._proto` for the handshake).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path

SECRET_FILE_ENV = "STAGERUN_SECRET_FILE"
SECRET_ENV = "STAGERUN_SECRET"
MIN_SECRET_BYTES = 16


def lane_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The lane secret of this process, or None when lanes are not authenticated.

    A file's contents are used as they are, less one trailing newline.

    Raises:
        ValueError: the file cannot be read, or the secret is shorter than 16 bytes.
    """
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV)
    if path:
        try:
            secret = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the lane secret file {path} ({exc.strerror})") from None
        secret = secret.removesuffix(b"\n").removesuffix(b"\r")
        where = f"the lane secret file {path}"
    elif env.get(SECRET_ENV):
        secret = env[SECRET_ENV].encode()
        where = f"${SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where} holds {len(secret)} bytes; a lane secret needs at least "
            f"{MIN_SECRET_BYTES} (try: head -c 32 /dev/urandom | base64 > FILE)"
        )
    return secret


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
