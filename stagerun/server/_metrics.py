"""Server metrics and their Prometheus text exposition (format 0.0.4), through prometheus_client.

Each `Metrics` (one per app) has a private `prometheus_client.CollectorRegistry` of custom
collectors; nothing is registered globally. Counters and the duration histograms live in
`Metrics` and its collectors turn them into metric families. The live gauges (requests in
flight, lanes, stages up, stage 0's ticks and batch sizes) are read from their owners by
collectors while `/metrics` is being written, so they are never stale: `Metrics.render` holds
the `Scrape` (what the handler probed and sampled) for exactly that long.

The text is written from the registry's families by `text_format`, not `generate_latest`:
`generate_latest` writes every value as a float (``7.0``, ``le="1.0"``,
``1.073741824e+09``) and sorts the labels by name, and the exposition here keeps integers
as integers and labels in the order each family declares them, as it always has.

Busy fractions are rates, so they need a window: a `BusySampler` compares what each stage
has used now with what it had used at its previous call (its first call: since the sampler
was made, at the server's start). `/metrics` and `/health` each keep their own, so a health
checker polling does not shorten the scraper's window.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._driver._lanes import LanePool
from .._driver._pipeline import Pipeline
from .._driver._supervise import STATES, StageProcess, is_serving, running_pids
from .._driver._values import StageHealth
from .._engine._batcher import TickBatcher
from .._util import cpu_seconds
from ._admission import Admission

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RUNNING_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def text_format(families: Iterable[Metric]) -> str:
    """The Prometheus text exposition of ``families`` (such as a registry's `collect()`)."""
    out: list[str] = []
    for family in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        help_text = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {family.type}")
        out.extend(f"{s.name}{_labels(s.labels)} {_number(s.value)}" for s in family.samples)
    return "\n".join(out) + "\n"


@attrs.define
class Histogram:
    """Cumulative bucket counts, their sum and count: one label set of a histogram family."""

    buckets: Sequence[float] = DURATION_BUCKETS
    counts: list[int] = attrs.field(init=False)
    total: float = 0.0
    count: int = 0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    @classmethod
    def from_counts(cls, counts: Mapping[int, int], buckets: Sequence[float]) -> Histogram:
        """The histogram of ``counts`` (value: times seen), such as a `collections.Counter`."""
        hist = cls(buckets=buckets)
        for value, times in counts.items():
            hist.observe(value, times)
        return hist

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value`` (``times`` times) in every bucket it fits: the buckets are cumulative."""
        self.total += value * times
        self.count += times
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += times

    def add_to(self, family: Metric, labels: Mapping[str, str] | None = None) -> None:
        """Add its samples (buckets, ``+Inf``, sum, count) to ``family`` under ``labels``."""
        labels = dict(labels or {})
        name = family.name
        for bound, count in zip(self.buckets, self.counts, strict=True):
            family.add_sample(f"{name}_bucket", {**labels, "le": _number(bound)}, count)
        family.add_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, self.count)
        family.add_sample(f"{name}_sum", labels, self.total)
        family.add_sample(f"{name}_count", labels, self.count)

    def family(self, name: str, help_text: str) -> Metric:
        """Itself as the unlabelled histogram family ``name``."""
        family = Metric(name, help_text, "histogram")
        self.add_to(family)
        return family

    def lines(self, name: str, help_text: str) -> list[str]:
        """Its exposition as the unlabelled histogram ``name``."""
        return text_format([self.family(name, help_text)]).splitlines()


class BusySampler:
    """Each stage's busy fraction over the time between two calls of `sample`.

    Stage 0's is the share of the window its tick batcher computed (at most 1). A supervised
    stage process's is the CPU time it used (user + system) per second of the window, above 1
    when it computes on several threads. Stages that run as tasks of this process (``inproc``)
    or elsewhere (a topology, ``remote``) have no sample. A stage process restarted within the
    window is measured from its start: what its predecessor used since the previous call is
    lost.

    Args:
        pipeline: the pipeline whose stages are measured.
        clock: seconds on a monotonic clock.
        cpu: CPU seconds a pid has used (`cpu_seconds`).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[int], float | None] = cpu_seconds,
    ) -> None:
        self._pipeline, self._clock, self._cpu = pipeline, clock, cpu
        self._at = clock()
        self._used = self._read()

    def __repr__(self) -> str:
        return f"<BusySampler stages={sorted(self._used)} since={self._at:.3f}>"

    def _read(self) -> dict[int, tuple[int | None, float]]:
        """Each measured stage's (pid, seconds busy or on CPU so far); stage 0's pid is None."""
        used: dict[int, tuple[int | None, float]] = {0: (None, self._pipeline.batcher.busy_seconds)}
        for index, pid in running_pids(self._pipeline.stages).items():
            seconds = self._cpu(pid)
            if seconds is not None:
                used[index] = (pid, seconds)
        return used

    def sample(self) -> dict[int, float]:
        """The busy fraction of each measured stage since the previous call, by stage index."""
        now, used = self._clock(), self._read()
        window = now - self._at
        out: dict[int, float] = {}
        for index, (pid, seconds) in used.items():
            before_pid, before = self._used.get(index, (pid, 0.0))
            if before_pid != pid:  # started within the window: all its time is in it
                before = 0.0
            if window > 0:
                out[index] = max(0.0, seconds - before) / window
        if 0 in out:
            out[0] = min(1.0, out[0])  # a tick is counted when it ends, perhaps in a later window
        self._at, self._used = now, used
        return out


def tick_summary(batcher: TickBatcher) -> dict[str, Any]:
    """``/health``'s view of a stage's ticks: how many, and the mean forwards one took."""
    mean = batcher.items / batcher.ticks if batcher.ticks else None
    return {
        "ticks": batcher.ticks,
        "mean_items_per_tick": None if mean is None else round(mean, 3),
    }


@attrs.frozen
class Scrape:
    """What one scrape reads besides the counts: the live gauges' owners, and what its handler
    probed (``health``) and sampled (``busy``: each stage's busy fraction, by index)."""

    admission: Admission
    pool: LanePool | None
    health: Sequence[StageHealth]
    pipeline: Pipeline | None = None
    busy: Mapping[int, float] | None = None


class _Counted(Collector):
    """Families of what a `Metrics` counted, made when the registry is collected."""

    def __init__(self, metrics: Metrics, make: Callable[[Metrics], Iterator[Metric]]) -> None:
        self._metrics, self._make = metrics, make

    def collect(self) -> Iterator[Metric]:
        return self._make(self._metrics)


class _Live(Collector):
    """Families read from the scrape `Metrics.render` is writing; none between scrapes."""

    def __init__(self, metrics: Metrics, make: Callable[[Scrape], Iterator[Metric]]) -> None:
        self._metrics, self._make = metrics, make

    def collect(self) -> Iterator[Metric]:
        scrape = self._metrics.scrape
        return iter(()) if scrape is None else self._make(scrape)


class Metrics:
    """What the server counts while it runs, and the registry `/metrics` is written from."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.durations: dict[str, Histogram] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0
        self.time_to_first_token = Histogram()
        self.decode_seconds = Histogram()
        self.prefill_chunks = 0
        self.draft_tokens = 0
        self.draft_tokens_accepted = 0
        self.windows_switched_off = 0
        self.running_at_admission = Histogram(buckets=RUNNING_BUCKETS)
        self.scrape: Scrape | None = None
        # Registered in the order the families are written.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Counted(self, _request_families))
        for live in (_pipeline_families, _busy_families):
            self.registry.register(_Live(self, live))
        self.registry.register(_Counted(self, _disconnect_families))
        for live in (_admission_families, _lane_families, _prefix_families, _stage_up_families):
            self.registry.register(_Live(self, live))

    def observe_running(self, running: int) -> None:
        """Sample the requests running, as one more starts (`Admission`'s ``on_start``)."""
        self.running_at_admission.observe(running)

    def __repr__(self) -> str:
        return (
            f"<Metrics requests={sum(self.requests.values())} prompt_tokens={self.prompt_tokens} "
            f"completion_tokens={self.completion_tokens} disconnects={self.disconnects}>"
        )

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[(endpoint, status)] += 1
        self.durations.setdefault(endpoint, Histogram()).observe(seconds)

    def observe_tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def observe_timings(self, timings: Mapping[str, object]) -> None:
        """Fold one finished request's ``timings`` (see `stagerun.Completion`) in."""

        def number(key: str) -> float:
            value = timings.get(key, 0)
            return float(value) if isinstance(value, (int, float)) else 0.0

        self.time_to_first_token.observe(number("prompt_ms") / 1000.0)
        self.decode_seconds.observe(number("predicted_ms") / 1000.0)
        self.prefill_chunks += int(number("prefill_chunks")) or 1
        self.draft_tokens += int(number("draft_n"))
        self.draft_tokens_accepted += int(number("draft_n_accepted"))
        self.windows_switched_off += int(bool(timings.get("speculative_drafting_switched_off")))

    def render(
        self,
        *,
        admission: Admission,
        pool: LanePool | None,
        health: Sequence[StageHealth],
        pipeline: Pipeline | None = None,
        busy: Mapping[int, float] | None = None,
    ) -> str:
        """The Prometheus text exposition of everything above plus the live gauges.

        ``busy`` is each stage's busy fraction by index (a `BusySampler`'s sample).
        """
        self.scrape = Scrape(admission, pool, health, pipeline, busy)
        try:
            return text_format(self.registry.collect())
        finally:
            self.scrape = None


def _one(
    kind: str, name: str, help_text: str, value: float | None, labels: Sequence[str] | None = None
) -> CounterMetricFamily | GaugeMetricFamily:
    """A counter or gauge: unlabelled with ``value`` (None: no sample), or with ``labels``."""
    if kind == "counter":
        return CounterMetricFamily(name, help_text, value=value, labels=labels)
    return GaugeMetricFamily(name, help_text, value=value, labels=labels)


def _by_stage(
    family: CounterMetricFamily | GaugeMetricFamily, values: Iterable[tuple[int, float]]
) -> Metric:
    for index, value in values:
        family.add_metric([str(index)], value)
    return family


def _request_families(m: Metrics) -> Iterator[Metric]:
    """Requests, their durations, tokens and timings, as the server counted them."""
    requests = CounterMetricFamily(
        "stagerun_requests_total",
        "HTTP requests answered, by endpoint and status code.",
        labels=["endpoint", "status"],
    )
    for (endpoint, status), n in sorted(m.requests.items()):
        requests.add_metric([endpoint, str(status)], n)
    yield requests
    durations = Metric(
        "stagerun_request_duration_seconds", "Time to answer a request (whole stream).", "histogram"
    )
    for endpoint, hist in sorted(m.durations.items()):
        hist.add_to(durations, {"endpoint": endpoint})
    yield durations
    for name, help_text, value in (
        ("stagerun_prompt_tokens_total", "Prompt tokens processed.", m.prompt_tokens),
        ("stagerun_completion_tokens_total", "Tokens generated.", m.completion_tokens),
    ):
        yield _one("counter", name, help_text, value)
    for name, help_text, hist in (
        ("stagerun_time_to_first_token_seconds", "Prompt to first token (prefill).",
         m.time_to_first_token),
        ("stagerun_decode_seconds", "First token to last token.", m.decode_seconds),
        ("stagerun_running_requests", "Requests running, sampled as each one starts.",
         m.running_at_admission),
    ):  # fmt: skip
        yield hist.family(name, help_text)
    for name, help_text, value in (
        ("stagerun_prefill_chunks_total", "Prefill chunks sent through the stages.",
         m.prefill_chunks),
        ("stagerun_draft_tokens_total", "Draft tokens proposed in verify windows.",
         m.draft_tokens),
        ("stagerun_draft_tokens_accepted_total", "Draft tokens the target model accepted.",
         m.draft_tokens_accepted),
        ("stagerun_speculation_switched_off_total",
         "Requests whose drafting was switched off as not paying.", m.windows_switched_off),
    ):  # fmt: skip
        yield _one("counter", name, help_text, value)


def _disconnect_families(m: Metrics) -> Iterator[Metric]:
    help_text = "Generations cancelled because the client went away."
    yield _one("counter", "stagerun_client_disconnects_total", help_text, m.disconnects)


def _pipeline_families(scrape: Scrape) -> Iterator[Metric]:
    """Recoveries, the supervised stage processes, and stage 0's ticks and batch sizes."""
    pipeline = scrape.pipeline
    if pipeline is None:
        return
    for name, help_text, value in (
        ("stagerun_recoveries_total", "Lane failures requests survived by replaying.",
         pipeline.recoveries),
        ("stagerun_recovery_failures_total", "Requests that failed because no lane came back.",
         pipeline.recovery_failures),
    ):  # fmt: skip
        yield _one("counter", name, help_text, value)
    processes = [
        (s.index, s.process) for s in pipeline.stages if isinstance(s.process, StageProcess)
    ]
    if processes:
        help_text = "Restarts of supervised stage processes."
        restarts = _one("counter", "stagerun_stage_restarts_total", help_text, None, ["stage"])
        yield _by_stage(restarts, ((index, process.restarts) for index, process in processes))
        states = GaugeMetricFamily(
            "stagerun_stage_process_state",
            "1 for the state each supervised stage process is in (failed: given up after too "
            "many exits, until its port is free again), 0 for the others.",
            labels=["stage", "state"],
        )
        for index, process in processes:
            for state in STATES:
                states.add_metric([str(index), state], int(process.state == state))
        yield states
    yield from _tick_families(pipeline.batcher)


def _tick_families(batcher: TickBatcher) -> Iterator[Metric]:
    """Stage 0's tick counters and batch size histogram."""
    for name, help_text, value in (
        ("stagerun_stage0_ticks_total", "Batched forwards stage 0 computed.", batcher.ticks),
        ("stagerun_stage0_rows_total", "Token rows stage 0's ticks computed.", batcher.rows),
    ):
        yield _one("counter", name, help_text, value)
    hist = Histogram.from_counts(batcher.batch_sizes, BATCH_BUCKETS)
    yield hist.family("stagerun_stage0_batch_size", "Forwards (requests) per stage 0 tick.")


def _busy_families(scrape: Scrape) -> Iterator[Metric]:
    if scrape.busy is None:
        return
    busy = GaugeMetricFamily(
        "stagerun_stage_busy_ratio",
        "Share of the time since the previous scrape (the first: since the server started) "
        "the stage computed: stage 0's ticks, or a stage process's CPU seconds per second "
        "(above 1 on several threads). No sample for in-process or remote stages.",
        labels=["stage"],
    )
    yield _by_stage(busy, sorted(scrape.busy.items()))


def _admission_families(scrape: Scrape) -> Iterator[Metric]:
    """The admission gauges: running, queued, refused, and the limits they run within."""
    a = scrape.admission
    for kind, name, help_text, value in (
        ("gauge", "stagerun_requests_in_flight", "Requests generating now.", a.running),
        ("gauge", "stagerun_requests_queued", "Requests waiting for a slot and KV budget.",
         a.queued),
        ("counter", "stagerun_requests_rejected_total",
         "Requests refused with 429 because the queue was full.", a.rejected),
        ("gauge", "stagerun_max_batch", "Requests that may generate at once (--max-batch).",
         a.max_batch),
        ("gauge", "stagerun_kv_reserved_bytes",
         "KV cache bytes the running requests have reserved.", a.reserved),
        ("gauge", "stagerun_kv_budget_bytes",
         "KV cache bytes the running requests may reserve (--kv-budget).", a.kv_budget),
    ):  # fmt: skip
        yield _one(kind, name, help_text, value)


def _lane_families(scrape: Scrape) -> Iterator[Metric]:
    pool = scrape.pool
    if pool is None:
        return
    for kind, name, help_text, value in (
        ("gauge", "stagerun_lanes_idle", "Idle lanes in the pool.", pool.idle),
        ("gauge", "stagerun_lanes_busy", "Lanes lent to requests.", pool.busy),
        ("counter", "stagerun_lanes_replaced_total",
         "Lanes closed after a failed or cancelled request and replaced.", pool.replaced),
        ("counter", "stagerun_lane_replace_failures_total",
         "Replacement lanes that could not be connected.", pool.replace_failures),
    ):  # fmt: skip
        yield _one(kind, name, help_text, value)


_PREFIX_FAMILIES = (
    ("hits", "counter", "Requests that started from at least one cached prefix block."),
    ("misses", "counter", "Requests that asked for cached prefix blocks and got none."),
    ("hit_tokens", "counter", "Prompt positions restored from the prefix cache."),
    ("lookup_tokens", "counter", "Prompt positions asked of the prefix cache."),
    ("stored_blocks", "counter", "Prefix blocks copied into the cache."),
    ("evicted_blocks", "counter", "Prefix blocks evicted (least recently used first)."),
    ("blocks", "gauge", "Prefix blocks the cache holds now (16 positions each)."),
    ("bytes", "gauge", "Bytes of KV the prefix cache holds now."),
    ("max_bytes", "gauge", "Bytes of KV the prefix cache may hold (--prefix-cache-mb)."),
)


def _prefix_families(scrape: Scrape) -> Iterator[Metric]:
    """Each stage's prefix cache counters, from the probes of this scrape."""
    caches = [(h.stage.index, h.prefix_cache) for h in scrape.health if h.prefix_cache is not None]
    for field, kind, help_text in _PREFIX_FAMILIES:
        name, help_text = f"stagerun_prefix_cache_{field}", help_text + " By stage."
        family = _one(kind, name, help_text, None, labels=["stage"])
        yield _by_stage(family, ((index, getattr(stats, field)) for index, stats in caches))


def _stage_up_families(scrape: Scrape) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        "stagerun_stage_up",
        "1 if the stage (its primary, or a standby) answered a handshake and, for a "
        "supervised stage process, that process is running, else 0.",
        labels=["stage", "address"],
    )
    for h in scrape.health:
        up.add_metric([str(h.stage.index), h.primary], 1 if is_serving(h) else 0)
    yield up
