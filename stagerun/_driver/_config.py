"""One value for everything a pipeline is asked to be, and the pure plan made from it.

Every setting type lives here: `PipelineConfig` and the three it holds, `SpeculationConfig`,
`RecoveryPolicy` and `SupervisionPolicy`.

`PipelineConfig` holds every setting of `stagerun.open_pipeline` (its topology, plugins, device,
threads, link emulation, capacity, prefill, speculation, recovery, supervision, timeouts); the
command line builds one from its arguments in one place (`stagerun._cli._config`), and
``stagerun serve`` carries one inside its options. `plan` checks a configuration against a
model's layer count and works out each stage's layers, backend, device and listen address,
without a socket or a thread: what `open_pipeline` refuses, `plan` refuses first.

Adding a pipeline option means: a field here (with its check in `plan` if it needs one), its
command-line flag and mapping in `stagerun._cli`, and its docs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from .. import _decide, plugins
from .._decide._prefill import ChunkPolicy
from .._engine._prefix import DEFAULT_PREFIX_CACHE_MB
from .._proto import ActivationDType
from .._wire._framed import LinkEmulation

Mode = Literal["inproc", "processes"]
DEFAULT_PREFILL_CHUNK = "adaptive"
DEFAULT_PREFILL_CREDIT = 3  # prefill chunks in flight past stage 0, unacknowledged
# A stage process that exits this often is given up (systemd's StartLimitBurst is 5 too): with
# the 0.2 s backoff doubling, five quick failures take about 10 s of trying, long enough to
# ride out a transient cause, short enough that clients are told soon.
DEFAULT_MAX_FAILURES = 5
DEFAULT_FAILURE_WINDOW = 60.0  # seconds; exits older than this are forgotten


@attrs.frozen
class SpeculationConfig:
    """How a pipeline speculates.

    Attributes:
        drafter: ``off``, or a drafter plugin: ``ngram`` (prompt lookup), ``draft-model``, or
            an installed plugin's name.
        depth: verify windows kept in flight per request (1 = serial).
        window: draft tokens per window at most.
        adaptive: let the window width follow acceptance, and stop drafting for a request
            whose acceptance is too low to pay for the windows.
        draft_model: the GGUF (name or path) for ``draft-model``.
    """

    drafter: str = "off"
    depth: int = 4
    window: int = 4
    adaptive: bool = True
    draft_model: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.drafter != "off" and self.drafter not in plugins.names("drafters"):
            choices = ", ".join(["off", *plugins.names("drafters")])
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {choices}")
        if not 1 <= self.depth <= _decide.MAX_VERIFY_WINDOW_DEPTH:
            raise ValueError(
                f"depth must be within 1..{_decide.MAX_VERIFY_WINDOW_DEPTH}, got {self.depth}"
            )
        if not 1 <= self.window <= 32:
            raise ValueError(f"window must be within 1..32 draft tokens, got {self.window}")
        if self.drafter == "draft-model" and not self.draft_model:
            raise ValueError("the draft-model drafter needs a draft model (--draft-model)")

    @property
    def enabled(self) -> bool:
        return self.drafter != "off"


@attrs.frozen
class RecoveryPolicy:
    """How a request survives a lane that breaks under it (see docs/reliability.md).

    When a lane fails mid-request (a stage killed, a connection reset, a reply timeout), stage
    0 waits ``backoff`` seconds (doubling up to ``max_backoff``), checks out a fresh lane --
    which reaches the restarted stage -- and replays the committed tokens (prompt plus
    everything already generated) as a prefill to rebuild every KV cache; decoding then goes
    on where it stopped, and the caller sees one uninterrupted stream. Sampling depends only
    on the seed and the position, so the continuation is the one the request would have had.

    Args:
        max_breaks: lane failures one request survives; the next one fails it.
        timeout: seconds one recovery may take (waiting for the stage included) before the
            request fails with `RecoveryFailedError`. Default
            ``$STAGERUN_RECOVERY_TIMEOUT_SECS`` or 60.
        backoff: first wait between attempts, in seconds.
        max_backoff: the longest wait between attempts.
    """

    max_breaks: int = 3
    timeout: float = attrs.field(
        factory=lambda: float(os.environ.get("STAGERUN_RECOVERY_TIMEOUT_SECS", "60"))
    )
    backoff: float = 0.1
    max_backoff: float = 0.5

    @classmethod
    def disabled(cls) -> RecoveryPolicy:
        """Fail a request at its first lane failure."""
        return cls(max_breaks=0)


@attrs.frozen
class SupervisionPolicy:
    """How `open_pipeline` looks after the stage processes it starts.

    Args:
        restart: start a stage again when its process exits.
        backoff: first wait before a restart, in seconds; doubles up to ``max_backoff``.
        stable_after: a process that ran this long resets the backoff.
        probe_interval: seconds between liveness probes (0 turns probing off).
        probe_timeout: a probe's handshake deadline.
        probe_failures: failed probes in a row before a live process is killed.
        ready_timeout: seconds a (re)started process has to print its ready line.
        max_failures: exits within ``failure_window`` seconds after which the stage is
            given up (state ``failed``): it is not started again, and requests that need it
            fail at once instead of waiting for a recovery that cannot come.
        failure_window: the window, in seconds, ``max_failures`` is counted over.
    """

    restart: bool = True
    backoff: float = 0.2
    max_backoff: float = 10.0
    stable_after: float = 30.0
    probe_interval: float = 2.0
    probe_timeout: float = 5.0
    probe_failures: int = 3
    ready_timeout: float = 120.0
    max_failures: int = DEFAULT_MAX_FAILURES
    failure_window: float = DEFAULT_FAILURE_WINDOW

    def __attrs_post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be at least 1, got {self.max_failures}")
        if not self.failure_window > 0:
            raise ValueError(f"failure_window must be positive, got {self.failure_window}")

    def gives_up(self, exits: Sequence[float]) -> bool:
        """Whether a stage whose process exited at the times ``exits`` (oldest first, the
        latest exit last) is given up rather than restarted.

        True once ``max_failures`` of them fall within ``failure_window`` seconds up to the
        latest: the doubling backoff alone would restart a stage that cannot start (its port
        taken, its model file gone) forever, every ``max_backoff`` seconds.
        """
        if not exits:
            return False
        since = exits[-1] - self.failure_window
        return sum(1 for t in exits if t > since) >= self.max_failures

    def restart_delay(self, previous: float | None, uptime: float) -> float:
        """Seconds to wait before restarting a process that exited after ``uptime`` seconds.

        Args:
            previous: the wait before the previous restart; None if this is the first one.
            uptime: how long the process that just exited served: from its ready line to its
                exit (0 when it never got ready, so a start that hangs until it is killed
                never counts as a stable run).

        Returns:
            ``backoff`` for the first restart and after a run longer than ``stable_after``;
            otherwise twice ``previous``, at most ``max_backoff``.
        """
        if previous is None or uptime > self.stable_after:
            return self.backoff
        return min(previous * 2, self.max_backoff)


def _tuple_or_none(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def _ranges(value: Sequence[Sequence[int]] | None) -> tuple[tuple[int, int], ...] | None:
    return None if value is None else tuple((int(lo), int(hi)) for lo, hi in value)


@attrs.frozen(kw_only=True)
class PipelineConfig:
    """How to start (or join) a pipeline; every field has the default `open_pipeline` uses.

    Attributes:
        stages: number of stages when ``layers`` is not given (layers split evenly).
        layers: explicit ``[lo, hi)`` ranges, one per stage, contiguous from 0.
        mode: ``inproc`` runs stages 1.. as Trio tasks here; ``processes`` spawns
            ``stagerun stage`` children on loopback.
        remote: addresses of already running stages 1..N-1 (then ``layers[0]`` or the even
            split says what stage 0 holds, and nothing is started here).
        host: the address stages started here listen on.
        threads: compute (BLAS) threads per stage.
        stage_threads: one thread count per stage instead, stage 0 first (a stage with a
            heavier layer range, or a host with more cores, gets more); entries of stages
            joined from elsewhere are ignored (they set their own).
        wire_dtype: activation dtype on the wire (f32, f16 or q8).
        capacity: lanes in the pool (concurrent requests served without connecting more).
        prefill_chunk: how prompts are cut into prefill chunks: ``"adaptive"`` (default: a
            ramp that grows while transport hides under compute), a size (``256``) or a
            schedule (``"128,256,384"``).
        prefill_credit: prefill chunks in flight past stage 0 at once (1 = wait for each).
        hop_delay_ms: emulate a WAN link: every frame on every lane is delivered this much
            later (stages started here and stage 0 alike; remote stages set their own).
        bandwidth_mbps: with ``hop_delay_ms``, also cap each link's bandwidth.
        speculation: speculative decoding settings (drafter, depth, window); off by default.
        transport: the transport plugin of every lane between stages started here (``tcp``,
            ``ws``, or an installed plugin's name).
        transports: one transport per hop instead (stage 0 to 1 first); the last stage's
            transport also carries the returns to stage 0.
        backend: the compute backend plugin of every stage started here (``numpy``, ...).
        backends: one backend per stage instead, stage 0 first (any mix).
        device: the compute device (``cuda``, ``cuda:1``, ``cpu``) for the stages whose backend
            takes one (torch); None lets each backend choose.
        recovery: how a request survives a lane failure (default `RecoveryPolicy()`: up to
            3 failures, 60 s each; ``RecoveryPolicy.disabled()`` fails at the first).
        supervision: restart and liveness settings for the stage processes started here
            (``mode="processes"``; default `SupervisionPolicy()`).
        reply_timeout: seconds stage 0 waits for a reply before the lane counts as broken
            (default ``$STAGERUN_STAGE_REPLY_TIMEOUT_SECS`` or 30).
        prefix_cache: reuse the KV of earlier requests' prefixes on every stage (on by
            default; a backend without `ComputeBackend.export_kv` keeps none).
        prefix_cache_mb: MiB of KV blocks each stage started here, and stage 0, may cache;
            running requests take KV room back from it whenever they need it.
        chat_template: a Jinja chat template (its text) for chat prompts in place of the
            model's; None uses the model's, and a model without one refuses chat prompts.
    """

    stages: int = 1
    layers: tuple[tuple[int, int], ...] | None = attrs.field(default=None, converter=_ranges)
    mode: Mode = "inproc"
    remote: tuple[str, ...] | None = attrs.field(default=None, converter=_tuple_or_none)
    host: str = "127.0.0.1"
    threads: int | None = None
    stage_threads: tuple[int, ...] | None = attrs.field(default=None, converter=_tuple_or_none)
    wire_dtype: ActivationDType = "f32"
    capacity: int = 1
    prefill_chunk: int | str | ChunkPolicy = DEFAULT_PREFILL_CHUNK
    prefill_credit: int = DEFAULT_PREFILL_CREDIT
    hop_delay_ms: float = 0.0
    bandwidth_mbps: float | None = None
    speculation: SpeculationConfig | None = None
    transport: str = "tcp"
    transports: tuple[str, ...] | None = attrs.field(default=None, converter=_tuple_or_none)
    backend: str = "numpy"
    backends: tuple[str, ...] | None = attrs.field(default=None, converter=_tuple_or_none)
    device: str | None = None
    recovery: RecoveryPolicy | None = None
    supervision: SupervisionPolicy | None = None
    reply_timeout: float | None = None
    prefix_cache: bool = True
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB
    chat_template: str | None = attrs.field(default=None, repr=False)

    @property
    def prefix_cache_bytes(self) -> int:
        """What each stage's prefix cache may hold: 0 when it is off."""
        return self.prefix_cache_mb << 20 if self.prefix_cache else 0

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes`` (field names as keywords); an unknown name is a TypeError."""
        unknown = sorted(set(changes) - set(attrs.fields_dict(PipelineConfig)))
        if unknown:
            raise TypeError(f"PipelineConfig has no setting {', '.join(map(repr, unknown))}")
        return attrs.evolve(self, **changes)

    @property
    def link(self) -> LinkEmulation:
        """The emulated link every lane started here runs over."""
        return LinkEmulation(
            delay_s=self.hop_delay_ms / 1000.0,
            bandwidth_bytes_per_s=self.bandwidth_mbps * 125_000.0 if self.bandwidth_mbps else None,
        )


@attrs.frozen
class StagePlan:
    """One stage as `plan` sees it: stage 0 first."""

    index: int
    layers: tuple[int, int]
    backend: str
    threads: int | None  # compute threads (None: the backend decides)
    device: str | None  # the configured device, where this stage's backend takes one
    listen: str | None  # where a stage started here listens (None: stage 0, or remote)
    remote: str | None  # the address of a stage already running elsewhere


@attrs.frozen
class PipelinePlan:
    stages: tuple[StagePlan, ...]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [stage.layers for stage in self.stages]


def split_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``stages`` contiguous ranges as evenly as possible."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    ranges, lo = [], 0
    for i in range(stages):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def plan(config: PipelineConfig, n_layers: int) -> PipelinePlan:
    """Check ``config`` against a model of ``n_layers`` layers and lay out its stages.

    Plugins are looked up (an unknown or broken one fails here), nothing is connected, started
    or loaded.

    Raises:
        ValueError: a setting contradicts another or the model (the message names both).
        stagerun.plugins.PluginError: a named transport or backend is missing or broken.
    """
    if config.hop_delay_ms < 0:
        raise ValueError(f"hop_delay_ms must not be negative, got {config.hop_delay_ms}")
    if config.prefix_cache_mb < 0:
        raise ValueError(f"prefix_cache_mb must not be negative, got {config.prefix_cache_mb}")
    remote = config.remote
    stages = len(remote) + 1 if remote is not None and config.layers is None else config.stages
    ranges = list(config.layers) if config.layers is not None else split_layers(n_layers, stages)
    _check_ranges(ranges, n_layers)
    hops = len(ranges) - 1
    if remote is not None and len(remote) != hops:
        raise ValueError(f"{len(ranges)} stages need {hops} remote addresses, got {len(remote)}")
    if config.transports is not None and len(config.transports) != hops:
        raise ValueError(
            f"{len(ranges)} stages have {hops} hops, but {len(config.transports)} "
            f"transports were given ({', '.join(config.transports)})"
        )
    hop_transports = list(config.transports or [config.transport] * hops)
    listen = [plugins.transport(name).local_address(config.host) for name in hop_transports]
    if config.backends is not None and len(config.backends) != len(ranges):
        raise ValueError(
            f"{len(ranges)} stages need {len(ranges)} backends, got {len(config.backends)} "
            f"({', '.join(config.backends)})"
        )
    backends = list(config.backends or [config.backend] * len(ranges))
    for name in backends:
        plugins.backend(name)  # an unknown or broken plugin fails here, before anything starts
    threads: list[int | None] = list(config.stage_threads or [config.threads] * len(ranges))
    if len(threads) != len(ranges) or not all(t is None or t >= 1 for t in threads):
        raise ValueError(
            f"{len(ranges)} stages need {len(ranges)} thread counts of at least 1, got "
            f"{', '.join(map(str, threads))}"
        )
    devices = [config.device if plugins.takes_device(name) else None for name in backends]
    if config.device is not None and not any(devices):
        raise ValueError(
            f"--device {config.device} needs a backend with a device (torch); "
            f"these stages run {', '.join(backends)}"
        )
    return PipelinePlan(
        tuple(
            StagePlan(
                index=i,
                layers=ranges[i],
                backend=backends[i],
                threads=threads[i],
                device=devices[i],
                listen=None if i == 0 or remote is not None else listen[i - 1],
                remote=None if i == 0 or remote is None else remote[i - 1],
            )
            for i in range(len(ranges))
        )
    )


def _check_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    expected = 0
    for lo, hi in ranges:
        if lo != expected or hi <= lo:
            raise ValueError(
                f"stage layer ranges {list(ranges)} must be contiguous, non-empty and start at 0"
            )
        expected = hi
    if expected != n_layers:
        raise ValueError(
            f"stage layer ranges {list(ranges)} must end at the model's {n_layers} layers"
        )
