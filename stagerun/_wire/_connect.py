"""Dialling a stage: the address list, the handshake, the lane secret and the reply deadline.

Both ends of a lane use this: stage 0 to open its lanes, a middle stage to open its hop to the
next stage.
"""

from __future__ import annotations

import enum
import logging
import math
import os
from collections.abc import Mapping
from typing import Final

import trio

from .. import _proto, plugins
from .._errors import LaneError
from ._auth import lane_secret
from ._framed import NO_EMULATION, FrameStream, LinkEmulation, client_handshake

log = logging.getLogger("stagerun.lanes")

REPLY_TIMEOUT_ENV = "STAGERUN_STAGE_REPLY_TIMEOUT_SECS"
DEFAULT_REPLY_TIMEOUT = 30.0
DEFAULT_CONNECT_TIMEOUT = 60.0


class EnvSecret(enum.Enum):
    """The default of ``secret`` arguments: read the environment (`lane_secret`)."""

    TOKEN = "the environment's lane secret"


ENV_SECRET: Final = EnvSecret.TOKEN


def stage_reply_timeout(environ: Mapping[str, str] | None = None) -> float:
    """The steady-state read/write timeout in seconds (env, default 30, clamped 1..3600)."""
    env = os.environ if environ is None else environ
    raw = env.get(REPLY_TIMEOUT_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_REPLY_TIMEOUT
    if not math.isfinite(value):
        return DEFAULT_REPLY_TIMEOUT
    return min(max(value, 1.0), 3600.0)


def alternatives(address: str) -> list[str]:
    """The addresses in ``address``: one, or a primary and its standbys separated by commas."""
    parts = [part.strip() for part in address.split(",")]
    if not all(parts):
        raise ValueError(f"address list {address!r} has an empty entry")
    return parts


async def open_connection(
    address: str,
    *,
    role: _proto.Role,
    key: int = 0,
    connect_timeout: float,
    ready_timeout: float,
    link: LinkEmulation = NO_EMULATION,
    secret: bytes | EnvSecret | None = ENV_SECRET,
) -> FrameStream:
    """Connect to a stage and complete the handshake.

    ``secret`` authenticates the lane (both ways); by default it is this process's
    `stagerun._wire._auth.lane_secret`, None turns authentication off.
    """
    if isinstance(secret, EnvSecret):
        secret = lane_secret()
    candidates = alternatives(address)
    if len(candidates) > 1:  # a standby is tried when the one before fails
        failures: list[str] = []
        for candidate in candidates:
            try:
                return await open_connection(
                    candidate,
                    role=role,
                    key=key,
                    connect_timeout=connect_timeout,
                    ready_timeout=ready_timeout,
                    link=link,
                    secret=secret,
                )
            except LaneError as exc:
                log.info("%s unavailable (%s); trying the next standby", candidate, exc)
                failures.append(f"{candidate}: {exc}")
                last = exc
        # Every address failed: say so for each (the primary first), as the last one's kind.
        raise type(last)(f"no address of the stage answered ({'; '.join(failures)})") from last
    address = candidates[0]
    stream = await plugins.transport_for(address).connect(address, timeout=connect_timeout)
    try:
        return await client_handshake(
            stream,
            peer=address,
            role=role,
            key=key,
            ready_timeout=ready_timeout,
            link=link,
            secret=secret,
        )
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
