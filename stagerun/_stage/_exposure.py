"""Who may connect to a stage: refused without a lane secret beyond loopback, warned about.

A stage without a lane secret serves anyone who can reach its port. Beyond loopback it
refuses to start unless told ``--insecure`` (`StageConfig.insecure`); on loopback, and with
``--insecure``, it says so in one warning at start. A stage with a secret that serves plain
``tcp://`` or ``ws://`` beyond loopback warns that its frames are unprotected after the
handshake (docs/reliability.md, "Who may connect").
"""

from __future__ import annotations

import logging

from .._wire._address import parse_address
from .._wire._auth import SECRET_FILE_ENV, is_loopback
from ..transports._websocket import parse_ws_address

__all__ = ["PLAIN_SCHEMES", "check_exposure"]

log = logging.getLogger("stagerun.stage")

PLAIN_SCHEMES = ("tcp", "ws")  # transports whose frames cross the network unprotected


def check_exposure(address: str, secret: bytes | None, index: int, *, insecure: bool) -> None:
    """Refuse to serve beyond loopback without a lane secret unless ``insecure``; warn about
    a loopback stage without one, then about what `_warn_if_open` warns about.

    Raises:
        ValueError: no secret, an address beyond loopback, and not ``insecure``.
    """
    host = _host(address)
    if host is not None and secret is None:
        if not is_loopback(host) and not insecure:
            raise ValueError(
                f"stage {index} would serve {address} with no lane secret, so anyone who can "
                f"reach it could send it work: give every stage the same --secret-file (or "
                f"${SECRET_FILE_ENV}), or pass --insecure to serve it open anyway"
            )
        if is_loopback(host):
            log.warning(
                "stage %d serves %s with no lane secret: any process on this machine can "
                "send it work (give every stage the same --secret-file to authenticate lanes)",
                index,
                address,
            )
    _warn_if_open(address, secret, index)


def _host(address: str) -> str | None:
    """The host ``address`` listens on, or None for a plugin's own address form."""
    scheme = address.partition("://")[0] if "://" in address else "tcp"
    try:
        if scheme in ("ws", "wss"):
            return parse_ws_address(address)[0]
        return parse_address(address)[1]
    except ValueError:
        return None  # a plugin's address form (unix://...): its own business


def _warn_if_open(address: str, secret: bytes | None, index: int) -> None:
    """Warn when a stage listens beyond this machine without a lane secret, or in the clear."""
    host = _host(address)
    if host is None or is_loopback(host):
        return
    scheme = address.partition("://")[0] if "://" in address else "tcp"
    if secret is None:
        log.warning(
            "stage %d serves %s without lane authentication: anyone who can reach it can "
            "send it work. Give every stage the same --secret-file (or $%s).",
            index,
            address,
            SECRET_FILE_ENV,
        )
    elif scheme in PLAIN_SCHEMES:
        log.warning(
            "stage %d serves %s in the clear: the lane secret authenticates each connection, "
            "but the frames after the handshake are neither encrypted nor protected against "
            "tampering, so anyone on the network path can read or change them. Serve on "
            "tls:// or wss:// to protect them.",
            index,
            address,
        )
