"""Every setting of a stage, declared and checked once, and the command line that carries it.

Theory of operation: `StageConfig` is a frozen value holding everything a stage is asked to
be: where it listens and forwards, how its lanes authenticate, what peers may make it hold,
how it batches, and the deadlines of its downstream dial. It checks itself when it is made
(and again after every `attrs.evolve`), so a `StageServer`, `serve_stage`, the ``stagerun
stage`` command and `stagerun.plan` all refuse the same settings with the same sentence,
``what @ where``.

A stage started as a process gets its configuration on its command line: `to_argv` writes it
as ``stagerun stage`` options and `StageConfig.from_args` reads them back, and a Hypothesis
test checks ``from_args(parse(to_argv(c))) == c``, so the launcher cannot drop a setting on
the way. The lane secret never goes on a command line (anyone on the machine can read one):
a stage process reads it from ``$STAGERUN_SECRET_FILE`` (`ENV_SECRET`, what the launcher
passes) or from a file named by ``--secret-file`` (`SecretFile`); a secret given as bytes
serves in-process stages only, and `to_argv` refuses it.

A new stage setting is a field here with its check in `_CHECKS`, its flag in
`stagerun._cli._options` (``stagerun stage``), and its line in `to_argv` and `from_args`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import attrs

from .. import _proto
from .._decide._ticks import DEFAULT_TICK_ROWS as DEFAULT_TICK_ROWS
from .._wire._address import format_address
from .._wire._auth import MIN_SECRET_BYTES, SECRET_FILE_ENV, lane_secret
from .._wire._connect import ENV_SECRET, EnvSecret, alternatives, stage_reply_timeout
from .._wire._framed import DEFAULT_HANDSHAKE_TIMEOUT, LinkEmulation
from ._batcher import INLINE_SECONDS, STALL_SECONDS

DEFAULT_LISTEN = "tcp://127.0.0.1:0"
DEFAULT_MAX_SESSIONS = 64  # 4x the server's default --max-batch: a lane per request, and spares
DEFAULT_MAX_KV_TOKENS = 131_072  # 16 requests (the default --max-batch) at 8192 positions each
DEFAULT_PREFIX_CACHE_MB = 512  # per stage process; running requests win over it anyway
DEFAULT_INLINE_COMPUTE_MS = INLINE_SECONDS * 1e3  # a quick tick of one forward, on the loop
DEFAULT_STALL_TIMEOUT = STALL_SECONDS  # a compute showing no progress this long has hung
# What peers may hold of one stage (see "Connection limits" in `stagerun._stage._server`).
DEFAULT_MAX_CONNECTIONS = 1024  # far above an honest pipeline's lanes, standbys and probes
DEFAULT_MAX_HANDSHAKES = 64  # honest peers take a round trip or two; pools connect one by one
DEFAULT_IDLE_TIMEOUT = 600.0  # stage 0 replaces idle lanes found closed: minutes cost nothing
# Partial frames of all connections together (`stagerun._wire._budget`): by default one frame
# of the largest size (its payload, its header raw and parsed: 2.3 MiB at most, and a read) and
# room besides for a dozen prefill chunks arriving at once; never less than 32 MiB.
DEFAULT_MIN_PARTIAL_BYTES = 32 << 20
PARTIAL_OVER_PAYLOAD = 4 << 20
PARTIAL_BESIDES = 12 << 20
# The dial of the downstream hop: each attempt's deadlines, and how long a middle stage keeps
# retrying a downstream stage that refuses (it may still be starting).
DEFAULT_DOWNSTREAM_CONNECT_TIMEOUT = 2.0
DEFAULT_DOWNSTREAM_READY_TIMEOUT = 10.0
DEFAULT_DOWNSTREAM_RETRY_WINDOW = 30.0
MIB = 1 << 20


@attrs.frozen
class SecretFile:
    """A lane secret read from a private file (``--secret-file PATH``), where it is used."""

    path: str = attrs.field(converter=os.path.abspath)


LaneSecret = bytes | SecretFile | EnvSecret | None


def _secret_repr(secret: LaneSecret) -> str:
    if isinstance(secret, bytes):
        return f"<secret: {len(secret)} bytes>"  # never the bytes themselves
    return repr(secret)


def _layer_range(value: tuple[int, int]) -> tuple[int, int]:
    lo, hi = value
    return int(lo), int(hi)


def _no_cap_is_none(value: float | None) -> float | None:
    return value or None  # 0 Mbit/s is no cap, as on the command line


@attrs.frozen(kw_only=True)
class StageCompute:
    """What a stage process computes: the model file, its layers and the backend that runs them.

    An in-process stage is handed its backend built; a stage process builds it from this.
    """

    model: str
    layers: tuple[int, int] = attrs.field(converter=_layer_range)
    backend: str = "auto"
    threads: int | None = None
    device: str | None = None
    flash_attention: bool | None = None  # ggml's attention kernel (None: the backend's default)

    def __attrs_post_init__(self) -> None:
        lo, hi = self.layers
        if not self.model:
            raise ValueError("model must name a model or a GGUF path, got '' @ stage compute")
        if not 0 <= lo < hi:
            raise ValueError(
                f"layers must be LO:HI with 0 <= LO < HI, got {lo}:{hi} @ stage compute"
            )
        if not self.backend:
            raise ValueError("backend must name a backend plugin, got '' @ stage compute")
        if self.threads is not None and not _whole(self.threads, 1):
            raise ValueError(f"threads must be at least 1, got {self.threads!r} @ stage compute")
        if self.flash_attention not in (None, True, False):
            raise ValueError(
                f"flash_attention must be None, True or False, got {self.flash_attention!r} "
                "@ stage compute"
            )


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _at_least(least: int) -> Callable[[object], bool]:
    return lambda value: _whole(value, least)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _seconds(value: object, *, zero: bool = False, inf: bool = False) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return (value >= 0 if zero else value > 0) and (inf or value < math.inf)


def _secret_ok(secret: object) -> bool:
    if isinstance(secret, bytes):
        return len(secret) >= MIN_SECRET_BYTES
    return secret is None or isinstance(secret, (SecretFile, EnvSecret))


def _addresses(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        alternatives(value)
    except ValueError:
        return False
    return True


SECONDS = "a positive number of seconds"
# field -> (what it must be, its check)
_CHECKS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "index": ("a stage index of 0 or more", _at_least(0)),
    "compute": ("None or a StageCompute", _optional(lambda v: isinstance(v, StageCompute))),
    "downstream": ("None or addresses separated by commas, none empty", _optional(_addresses)),
    "listen": ("an address to listen on", lambda v: isinstance(v, str) and bool(v)),
    "wire_dtype": (
        f"one of {', '.join(_proto.ACTIVATION_DTYPES)}",
        lambda v: v in _proto.ACTIVATION_DTYPES,
    ),
    "hop_delay_ms": ("0 or more milliseconds", lambda v: _seconds(v, zero=True)),
    "bandwidth_mbps": ("None or a positive number of Mbit/s", _optional(_seconds)),
    "secret": (
        f"None, ENV_SECRET, a SecretFile or at least {MIN_SECRET_BYTES} bytes",
        _secret_ok,
    ),
    "handshake_timeout": (SECONDS, _seconds),
    "max_batch": ("None or at least 1", _optional(_at_least(1))),
    "tick_rows": ("at least 1", _at_least(1)),
    "inline_compute_ms": ("0 or more milliseconds", lambda v: _seconds(v, zero=True)),
    "max_sessions": ("at least 1", _at_least(1)),
    "max_kv_tokens": ("at least 1", _at_least(1)),
    "max_connections": ("at least 1", _at_least(1)),
    "max_handshakes": ("at least 1", _at_least(1)),
    "idle_timeout": (f"{SECONDS} (inf: never)", lambda v: _seconds(v, inf=True)),
    "stall_timeout": (f"{SECONDS} (inf: never)", lambda v: _seconds(v, inf=True)),
    "max_payload_bytes": ("at least 1", _at_least(1)),
    "max_partial_bytes": ("None or at least 1", _optional(_at_least(1))),
    "insecure": ("True or False", lambda v: isinstance(v, bool)),
    "prefix_cache_bytes": ("0 or more", _at_least(0)),
    "reply_timeout": (SECONDS, _seconds),
    "downstream_connect_timeout": (SECONDS, _seconds),
    "downstream_ready_timeout": (SECONDS, _seconds),
    "downstream_retry_window": ("0 or more seconds", lambda v: _seconds(v, zero=True)),
}


@attrs.frozen(kw_only=True)
class StageConfig:
    """Every setting of one stage; each field has the default a stage uses.

    Attributes:
        index: this stage's position in the pipeline (0 is the driver, servers are >= 1).
        compute: what a stage process computes (its model, layers and backend); None for a
            stage handed its backend built (then only `to_argv` needs it).
        downstream: address of the next stage, or None on the last stage; several addresses
            separated by commas are the next stage and its standbys, tried in order.
        listen: the address to serve on; its scheme picks the transport plugin.
        wire_dtype: activation dtype used when forwarding downstream.
        hop_delay_ms: emulate a WAN link: deliver every lane frame this much later.
        bandwidth_mbps: with the delay, also cap each link's bandwidth (None: no cap).
        secret: the lane secret: `ENV_SECRET` (``$STAGERUN_SECRET_FILE`` or
            ``$STAGERUN_SECRET``, read where it is used), a `SecretFile`, the bytes
            themselves (in-process stages only), or None (no authentication). The upstream
            handshake and the downstream dial both use it.
        handshake_timeout: seconds a connecting peer has to send its hello (and, with a lane
            secret, its nonce and proof); a peer that stalls is dropped after that.
        max_batch: sessions one tick computes together at most (1: no batching).
        tick_rows: rows one tick computes at most (a larger forward runs alone).
        inline_compute_ms: a tick of one session's decode step or verify window runs on the
            event loop's thread, saving a worker thread's two hand-offs, while such ticks
            take at most this long (0: always in a worker thread; see `TickBatcher`).
        max_sessions: requests open at once on this stage, over all its lanes; a
            ``Configure`` past it is answered with an ``Error``.
        max_kv_tokens: KV positions the caches of all those requests may reach together; a
            compute past it is answered with an ``Error``.
        max_connections: connections open at once, at most (lowered at start to what the
            open-file limit leaves room for); one more closes the one quiet longest.
        max_handshakes: connections in their handshake at once, at most; one more closes the
            oldest of them.
        stall_timeout: seconds a tick's compute may show no progress (since it began, or
            since the backend last reached a layer boundary) before the stage takes it to
            hang and refuses handshakes, so that its supervisor's liveness probe fails
            (``math.inf``: never).
        idle_timeout: seconds a connection may carry no byte either way before the stage
            closes it (``math.inf``: never).
        max_payload_bytes: the largest activation payload one frame from an upstream lane may
            carry; ``stagerun stage`` gives what the model's longest message needs, context x
            width in float32 (`stagerun._stage._server.payload_limit`).
        max_partial_bytes: what the partial frames of all connections may hold together; a
            connection that needs more room closes the stalest of them
            (`stagerun._wire._budget`). None: ``max_payload_bytes`` + 16 MiB, at least 32 MiB;
            it must hold one payload of ``max_payload_bytes`` and 4 MiB more.
        insecure: serve beyond loopback (and so to the network) without a lane secret; without
            it such a stage refuses to start.
        prefix_cache_bytes: what this stage's prefix cache may hold (0: no prefix cache). It
            also holds KV positions of ``max_kv_tokens``, which requests take back when they
            need them. A backend without `ComputeBackend.export_kv` keeps none.
        reply_timeout: the deadline of every write to a peer (default
            ``$STAGERUN_STAGE_REPLY_TIMEOUT_SECS`` or 30).
        downstream_connect_timeout: one downstream dial's connect deadline, in seconds.
        downstream_ready_timeout: one downstream dial's handshake (READY) deadline.
        downstream_retry_window: how long a refused downstream dial is retried (the next
            stage may still be starting) before the lane fails.
    """

    index: int
    compute: StageCompute | None = None
    downstream: str | None = None
    listen: str = DEFAULT_LISTEN
    wire_dtype: _proto.ActivationDType = "f32"
    hop_delay_ms: float = 0.0
    bandwidth_mbps: float | None = attrs.field(default=None, converter=_no_cap_is_none)
    secret: LaneSecret = attrs.field(default=ENV_SECRET, repr=_secret_repr)
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    max_batch: int | None = None
    tick_rows: int = DEFAULT_TICK_ROWS
    inline_compute_ms: float = DEFAULT_INLINE_COMPUTE_MS
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    max_payload_bytes: int = _proto.DEFAULT_MAX_PAYLOAD_BYTES
    max_partial_bytes: int | None = None
    insecure: bool = False
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MB * MIB
    reply_timeout: float = attrs.field(factory=stage_reply_timeout)
    downstream_connect_timeout: float = DEFAULT_DOWNSTREAM_CONNECT_TIMEOUT
    downstream_ready_timeout: float = DEFAULT_DOWNSTREAM_READY_TIMEOUT
    downstream_retry_window: float = DEFAULT_DOWNSTREAM_RETRY_WINDOW

    def __attrs_post_init__(self) -> None:
        for name, (requirement, check) in _CHECKS.items():
            if not check(getattr(self, name)):
                value = _secret_repr(self.secret) if name == "secret" else repr(getattr(self, name))
                raise ValueError(f"{name} must be {requirement}, got {value} @ stage {self.index}")

    @property
    def link(self) -> LinkEmulation:
        """The emulated link the stage's lanes run over."""
        bandwidth = self.bandwidth_mbps
        return LinkEmulation(
            delay_s=self.hop_delay_ms / 1000.0,
            bandwidth_bytes_per_s=bandwidth * 125_000.0 if bandwidth else None,
        )

    def partial_budget(self) -> int:
        """The bytes partial frames may hold on this stage (`max_partial_bytes` or its default).

        Raises:
            ValueError: ``max_partial_bytes`` cannot hold a frame of ``max_payload_bytes``.
        """
        least = self.max_payload_bytes + PARTIAL_OVER_PAYLOAD
        if self.max_partial_bytes is None:
            return max(DEFAULT_MIN_PARTIAL_BYTES, least + PARTIAL_BESIDES)
        if self.max_partial_bytes < least:
            raise ValueError(
                f"max_partial_bytes={self.max_partial_bytes} cannot hold one frame of "
                f"max_payload_bytes={self.max_payload_bytes} (it needs {least}, 4 MiB more) "
                f"@ stage {self.index}; raise --max-partial-bytes or lower --max-payload-bytes"
            )
        return self.max_partial_bytes

    def replace(self, **changes: Any) -> StageConfig:
        """A copy with ``changes`` (field names as keywords), checked again."""
        return attrs.evolve(self, **changes)

    def resolve_secret(self) -> bytes | None:
        """The secret's bytes now (a file or the environment is read again only when it
        changed), or None when lanes are not authenticated.

        Raises:
            ValueError: the secret file cannot be used (see `stagerun._wire._auth.lane_secret`).
        """
        secret = self.secret
        if isinstance(secret, EnvSecret):
            return lane_secret()
        if isinstance(secret, SecretFile):
            return lane_secret({SECRET_FILE_ENV: secret.path})
        return secret

    def check_backend(self, layers: tuple[int, int], is_last: bool) -> None:
        """Refuse a backend this configuration cannot serve (a downstream where the model
        ends, none where it goes on, or layers other than `compute`'s)."""
        lo, hi = layers
        if self.downstream is None and not is_last:
            raise ValueError(
                f"stage {self.index} holds layers {lo}..{hi} but has no downstream stage; "
                "give it --downstream or let it hold the model's last layer"
            )
        if self.downstream is not None and is_last:
            raise ValueError(
                f"stage {self.index} holds the model's last layer but has a downstream"
            )
        if self.compute is not None and self.compute.layers != (lo, hi):
            want = self.compute.layers
            raise ValueError(
                f"the backend computes layers {lo}..{hi} but the configuration names "
                f"{want[0]}..{want[1]} @ stage {self.index}"
            )

    @classmethod
    def from_settings(cls, config: StageConfig | None, settings: dict[str, Any]) -> StageConfig:
        """``config`` with ``settings`` replaced, or a configuration of ``settings`` alone."""
        if config is None:
            return cls(**settings)
        return config.replace(**settings) if settings else config

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StageConfig:
        """The configuration parsed ``stagerun stage`` options ask for (`to_argv`'s inverse).

        Raises:
            ValueError: the options contradict each other, or a setting is out of range.
        """
        if args.layers is None:
            raise ValueError(
                "give the stage its layers: --layers LO:HI, or --topology FILE --index I"
            )
        if args.no_secret and args.secret_file is not None:
            raise ValueError("give --secret-file or --no-secret, not both")
        secret: LaneSecret = ENV_SECRET
        if args.no_secret:
            secret = None
        elif args.secret_file is not None:
            secret = SecretFile(args.secret_file)
        compute = StageCompute(
            model=args.model or "smollm2",
            layers=args.layers,
            backend=args.backend or "auto",
            threads=args.threads,
            device=args.device,
            flash_attention=args.flash_attention,
        )
        reply = args.reply_timeout
        return cls(
            index=args.index,
            compute=compute,
            downstream=args.downstream,
            listen=args.listen or format_address("tcp", args.host, args.port),
            wire_dtype=args.wire_dtype,
            hop_delay_ms=args.hop_delay_ms,
            bandwidth_mbps=args.bandwidth_mbps,
            secret=secret,
            handshake_timeout=args.handshake_timeout,
            max_batch=args.max_batch,
            tick_rows=args.tick_rows,
            inline_compute_ms=args.inline_compute_ms,
            max_sessions=args.max_sessions,
            max_kv_tokens=args.max_kv_tokens,
            max_connections=args.max_connections,
            max_handshakes=args.max_handshakes,
            idle_timeout=args.idle_timeout,
            stall_timeout=args.stall_timeout,
            max_payload_bytes=args.max_payload_bytes or _proto.DEFAULT_MAX_PAYLOAD_BYTES,
            max_partial_bytes=args.max_partial_bytes,
            insecure=args.insecure,
            prefix_cache_bytes=args.prefix_cache_mb * MIB if args.prefix_cache == "on" else 0,
            reply_timeout=stage_reply_timeout() if reply is None else reply,
            downstream_connect_timeout=args.downstream_connect_timeout,
            downstream_ready_timeout=args.downstream_ready_timeout,
            downstream_retry_window=args.downstream_retry_window,
        )


def to_argv(config: StageConfig, *, listen: bool = True) -> list[str]:
    """The ``stagerun stage`` options of ``config`` (`StageConfig.from_args` reads them back).

    Every setting is written, defaults included, so a stage process serves what the launcher
    decided whatever its own defaults. ``listen=False`` leaves ``--listen`` out (a supervisor
    adds it, and keeps the address across restarts).

    Raises:
        ValueError: ``config`` has no `StageCompute`, its secret is bytes (a command line is
            readable by every user of the machine: give a `SecretFile`, or the environment's),
            or its prefix cache is not a whole number of MiB.
    """
    where = f"@ stage {config.index}"
    compute = config.compute
    if compute is None:
        raise ValueError(f"a stage process needs its model, layers and backend (compute) {where}")
    if isinstance(config.secret, bytes):
        raise ValueError(
            f"a lane secret given as bytes cannot go on a command line {where}; give it "
            f"as a file (SecretFile, or ${SECRET_FILE_ENV} in the stage's environment)"
        )
    if config.prefix_cache_bytes % MIB:
        raise ValueError(
            f"prefix_cache_bytes must be a whole number of MiB on a command line, got "
            f"{config.prefix_cache_bytes} {where}"
        )
    lo, hi = compute.layers
    argv = ["--index", str(config.index), "--model", compute.model, "--layers", f"{lo}:{hi}"]
    argv += ["--backend", compute.backend]
    if compute.threads is not None:
        argv += ["--threads", str(compute.threads)]
    if compute.device is not None:
        argv += ["--device", compute.device]
    if compute.flash_attention is not None:
        argv += ["--flash-attention", "on" if compute.flash_attention else "off"]
    if config.downstream is not None:
        argv += ["--downstream", config.downstream]
    if listen:
        argv += ["--listen", config.listen]
    argv += ["--wire-dtype", config.wire_dtype, "--hop-delay-ms", repr(config.hop_delay_ms)]
    if config.bandwidth_mbps is not None:
        argv += ["--bandwidth-mbps", repr(config.bandwidth_mbps)]
    if config.secret is None:
        argv += ["--no-secret"]
    elif isinstance(config.secret, SecretFile):
        argv += ["--secret-file", config.secret.path]  # the path, never the secret
    if config.insecure:
        argv += ["--insecure"]
    argv += ["--handshake-timeout", repr(config.handshake_timeout)]
    if config.max_batch is not None:
        argv += ["--max-batch", str(config.max_batch)]
    argv += [
        "--tick-rows", str(config.tick_rows),
        "--inline-compute-ms", repr(config.inline_compute_ms),
        "--max-sessions", str(config.max_sessions),
        "--max-kv-tokens", str(config.max_kv_tokens),
        "--max-connections", str(config.max_connections),
        "--max-handshakes", str(config.max_handshakes),
        "--idle-timeout", repr(config.idle_timeout),
        "--stall-timeout", repr(config.stall_timeout),
        "--max-payload-bytes", str(config.max_payload_bytes),
        "--reply-timeout", repr(config.reply_timeout),
        "--downstream-connect-timeout", repr(config.downstream_connect_timeout),
        "--downstream-ready-timeout", repr(config.downstream_ready_timeout),
        "--downstream-retry-window", repr(config.downstream_retry_window),
    ]  # fmt: skip
    if config.max_partial_bytes is not None:
        argv += ["--max-partial-bytes", str(config.max_partial_bytes)]
    if config.prefix_cache_bytes:
        argv += ["--prefix-cache-mb", str(config.prefix_cache_bytes // MIB)]
    else:
        argv += ["--prefix-cache", "off"]
    return argv
