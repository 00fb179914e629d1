"""One value for everything a pipeline is asked to be, and the pure plan made from it.

Every setting type is here: `PipelineConfig`, and the three it holds, `SpeculationConfig`,
`RecoveryPolicy` and `SupervisionPolicy` (declared in `._policies`, re-exported).

`PipelineConfig` holds every setting of `stagerun.open_pipeline` (its topology, plugins, device,
threads, link emulation, capacity, prefill, speculation, recovery, supervision, timeouts); the
command line builds one from its arguments in one place (`stagerun._cli._config`), and
``stagerun serve`` carries one inside its options. `plan` checks a configuration against a
model's layer count and works out each stage's layers, backend, device and listen address,
without a socket or a thread: what `open_pipeline` refuses, `plan` refuses first.

`plan` also builds the `StageConfig` of every stage started here (`stage_config`, what
`open_pipeline` then starts them with), so a stage-side setting it would refuse is refused
first too.

Adding a pipeline option means: a field here with its check in `_CHECKS` (or in `plan`, if it
depends on other fields), an invalid value for it in ``tests/test_config.py``, its
command-line flag and mapping in `stagerun._cli`, and its docs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .. import _proto, plugins
from .._decide._prefill import ChunkPolicy
from .._engine._config import (
    DEFAULT_INLINE_COMPUTE_MS,
    DEFAULT_MAX_KV_TOKENS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PREFIX_CACHE_MB,
    StageCompute,
    StageConfig,
)
from .._errors import LayerRangeError
from .._proto import ActivationDType
from .._util import default_threads
from .._wire._connect import alternatives
from .._wire._framed import LinkEmulation
from ..backends._ggml._cores import shares_cores
from ._checks import Mode as Mode
from ._checks import check_settings
from ._policies import DEFAULT_FAILURE_WINDOW as DEFAULT_FAILURE_WINDOW
from ._policies import DEFAULT_MAX_FAILURES as DEFAULT_MAX_FAILURES
from ._policies import DEFAULT_RECHECK_INTERVAL as DEFAULT_RECHECK_INTERVAL
from ._policies import RecoveryPolicy as RecoveryPolicy
from ._policies import SpeculationConfig as SpeculationConfig
from ._policies import SupervisionPolicy as SupervisionPolicy

DEFAULT_PREFILL_CHUNK = "adaptive"
DEFAULT_PREFILL_CREDIT = 3  # prefill chunks in flight past stage 0, unacknowledged


def _tuple_or_none(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def _ranges(value: Any) -> tuple[tuple[int, int], ...] | None:
    """Layer ranges as pairs: ``[(0, 15), (15, 30)]``, or as the CLI writes them: ``"0:15"``
    items, or one ``"0:15,15:30"`` string.

    Raises:
        LayerRangeError: an item is neither a pair of whole numbers nor ``LO:HI``.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    return tuple(_range(item) for item in value)


def _range(item: Any) -> tuple[int, int]:
    if isinstance(item, str):
        lo, sep, hi = item.partition(":")
        if sep and lo.strip().isdigit() and hi.strip().isdigit():
            return int(lo), int(hi)
    elif (
        isinstance(item, Sequence)
        and len(item) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in item)
    ):
        return int(item[0]), int(item[1])
    raise LayerRangeError(
        f"layer range {item!r} must be a pair (lo, hi) of whole numbers or 'LO:HI' like '0:15' "
        "@ PipelineConfig.layers"
    )


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
        flash_attention: for the stages whose backend takes it (ggml), attend with the fused
            kernel (True, llama.cpp's ``-fa on``) or as scores, softmax and values apart
            (False, ``-fa off``'s numerics); None: the backend's default (ggml: on).
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
        inline_compute_ms: how long a tick of one request's decode step may hold the event
            loop (stage 0's is this Trio run's) to save two thread hand-offs (0: never).
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
    backend: str = "auto"  # ggml where it runs, else numpy (`plugins.resolve_backend`)
    backends: tuple[str, ...] | None = attrs.field(default=None, converter=_tuple_or_none)
    device: str | None = None
    flash_attention: bool | None = None
    recovery: RecoveryPolicy | None = None
    supervision: SupervisionPolicy | None = None
    reply_timeout: float | None = None
    prefix_cache: bool = True
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB
    chat_template: str | None = attrs.field(default=None, repr=False)
    inline_compute_ms: float = DEFAULT_INLINE_COMPUTE_MS

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
    flash_attention: bool | None  # likewise (None: the backend's default)
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
        raise LayerRangeError(f"cannot split {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    ranges, lo = [], 0
    for i in range(stages):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def stage_config(
    config: PipelineConfig,
    stage: StagePlan,
    *,
    downstream: str | None,
    model: str | None = None,
    context_length: int = 0,
    max_payload_bytes: int = _proto.DEFAULT_MAX_PAYLOAD_BYTES,
) -> StageConfig:
    """The settings of ``stage``, started here by `open_pipeline` (and checked by `plan`).

    The stages' defaults suit 16 requests at once; a larger pool (`PipelineConfig.capacity`,
    ``serve --max-batch``) needs a session per lane, with spares for lanes being replaced,
    and room for every lane's request to reach the context (``context_length``).

    Args:
        downstream: the next stage's address (None on the last stage).
        model: the model's name or path, for a stage process to load (None: the stage is
            handed its backend).
        max_payload_bytes: the largest activation payload a frame may carry.
    """
    assert stage.listen is not None, "only stages started here have a configuration"
    compute = None
    if model is not None:
        compute = StageCompute(
            model=model,
            layers=stage.layers,
            backend=stage.backend,
            threads=stage.threads,
            device=stage.device,
            flash_attention=stage.flash_attention,
        )
    max_sessions, max_kv_tokens = session_limits(config, context_length)
    return StageConfig(
        index=stage.index,
        compute=compute,
        downstream=downstream,
        listen=stage.listen,
        wire_dtype=config.wire_dtype,
        hop_delay_ms=config.hop_delay_ms,
        bandwidth_mbps=config.bandwidth_mbps,
        max_sessions=max_sessions,
        max_kv_tokens=max_kv_tokens,
        max_payload_bytes=max_payload_bytes,
        prefix_cache_bytes=config.prefix_cache_bytes,
        inline_compute_ms=config.inline_compute_ms,
    )


def session_limits(config: PipelineConfig, context_length: int) -> tuple[int, int]:
    """What the sessions of a stage may hold: ``(max_sessions, max_kv_tokens)``.

    The same for every stage of the pipeline, stage 0 included (see `stage_config`).
    """
    return (
        max(DEFAULT_MAX_SESSIONS, 4 * config.capacity),
        max(DEFAULT_MAX_KV_TOKENS, config.capacity * context_length),
    )


def plan(config: PipelineConfig, n_layers: int) -> PipelinePlan:
    """Check ``config`` against a model of ``n_layers`` layers and lay out its stages.

    Plugins are looked up (an unknown or broken one fails here), nothing is connected, started
    or loaded.

    Raises:
        ValueError: a setting contradicts another or the model (the message names both).
        stagerun.plugins.PluginError: a named transport or backend is missing or broken.
    """
    check_settings(config)
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
    for address in remote or ():
        for candidate in alternatives(address):  # an empty entry fails here
            plugins.transport_for(candidate)  # and so does a scheme nobody serves
    plugins.transport(config.transport)  # an unknown or broken plugin fails here
    hop_transports = list(config.transports or [config.transport] * hops)
    listen = [plugins.transport(name).local_address(config.host) for name in hop_transports]
    if config.backends is not None and len(config.backends) != len(ranges):
        raise ValueError(
            f"{len(ranges)} stages need {len(ranges)} backends, got {len(config.backends)} "
            f"({', '.join(config.backends)})"
        )
    backends = [
        plugins.resolve_backend(name) for name in config.backends or [config.backend] * len(ranges)
    ]
    for name in backends:
        plugins.backend(name)  # an unknown or broken plugin fails here, before anything starts
    threads: list[int | None] = list(config.stage_threads or [config.threads] * len(ranges))
    if len(threads) != len(ranges) or not all(t is None or t >= 1 for t in threads):
        raise ValueError(
            f"{len(ranges)} stages need {len(ranges)} thread counts of at least 1, got "
            f"{', '.join(map(str, threads))}"
        )
    # ggml's threads spin at every barrier: the stages of one host share its cores, graph by
    # graph where they can (shares_cores), else each gets a fixed share
    on_host = len(ranges) if remote is None and not shares_cores() else 1
    threads = [
        default_threads(on_host) if t is None and name == "ggml" else t
        for t, name in zip(threads, backends, strict=True)
    ]
    devices, flash = _backend_options(config, backends)
    layout = PipelinePlan(
        tuple(
            StagePlan(
                index=i,
                layers=ranges[i],
                backend=backends[i],
                threads=threads[i],
                device=devices[i],
                flash_attention=flash[i],
                listen=None if i == 0 or remote is not None else listen[i - 1],
                remote=None if i == 0 or remote is None else remote[i - 1],
            )
            for i in range(len(ranges))
        )
    )
    started = [stage for stage in layout.stages[1:] if stage.listen is not None]
    for stage in started:  # what their servers would refuse, refused now
        last = stage.index == len(ranges) - 1
        stage_config(config, stage, downstream=None if last else stage.listen)
    return layout


def _backend_options(
    config: PipelineConfig, backends: list[str]
) -> tuple[list[str | None], list[bool | None]]:
    """Each stage's device and flash attention setting, None where its backend takes none."""
    devices = [config.device if plugins.takes(name, "device") else None for name in backends]
    if config.device is not None and not any(devices):
        raise ValueError(
            f"--device {config.device} needs a backend with a device (torch); "
            f"these stages run {', '.join(backends)}"
        )
    flash = [
        config.flash_attention if plugins.takes(name, "flash_attention") else None
        for name in backends
    ]
    if config.flash_attention is not None and all(f is None for f in flash):
        raise ValueError(
            f"--flash-attention needs a backend that takes it (ggml); these stages run "
            f"{', '.join(backends)}"
        )
    return devices, flash


def _check_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    expected = 0
    for lo, hi in ranges:
        if lo != expected or hi <= lo:
            raise LayerRangeError(
                f"stage layer ranges {list(ranges)} must be contiguous, non-empty and start at 0"
                " @ PipelineConfig.layers"
            )
        expected = hi
    if expected != n_layers:
        raise LayerRangeError(
            f"stage layer ranges {list(ranges)} must end at the model's {n_layers} layers"
            " @ PipelineConfig.layers"
        )
