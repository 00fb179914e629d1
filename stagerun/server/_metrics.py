"""Server metrics and their Prometheus text exposition (format 0.0.4), written by hand.

Counters and the duration histogram live in `Metrics`; gauges (requests in flight, lanes,
stages up) are read from their owners when `/metrics` is scraped, so they are never stale.
Stage 0's tick counts and batch sizes are its `TickScheduler`'s, read at scrape time too.

Busy fractions are rates, so they need a window: a `BusySampler` compares what each stage
has used now with what it had used at its previous call (its first call: since the sampler
was made, at the server's start). `/metrics` and `/health` each keep their own, so a health
checker polling does not shorten the scraper's window.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from .._driver._lanes import LanePool
from .._driver._pipeline import Pipeline
from .._driver._supervise import STATES, StageProcess, is_serving, running_pids
from .._driver._values import StageHealth
from .._engine._scheduler import TickScheduler
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


@attrs.define
class Histogram:
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

    def lines(self, name: str, help_text: str) -> list[str]:
        """Its exposition as the unlabelled histogram ``name``."""
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts, strict=True):
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {count}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_number(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


class BusySampler:
    """Each stage's busy fraction over the time between two calls of `sample`.

    Stage 0's is the share of the window its tick scheduler computed (at most 1). A supervised
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
        used: dict[int, tuple[int | None, float]] = {
            0: (None, self._pipeline.scheduler.busy_seconds)
        }
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


def tick_summary(scheduler: TickScheduler) -> dict[str, Any]:
    """``/health``'s view of a stage's ticks: how many, and the mean forwards one took."""
    mean = scheduler.items / scheduler.ticks if scheduler.ticks else None
    return {
        "ticks": scheduler.ticks,
        "mean_items_per_tick": None if mean is None else round(mean, 3),
    }


class Metrics:
    """What the server counts while it runs."""

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
        out: list[str] = []

        def family(
            name: str, kind: str, help: str, samples: Iterable[tuple[Mapping[str, str], float]]
        ) -> None:
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{_labels(labels)} {_number(value)}")

        family(
            "stagerun_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status code.",
            (
                ({"endpoint": endpoint, "status": str(status)}, n)
                for (endpoint, status), n in sorted(self.requests.items())
            ),
        )
        out.append(
            "# HELP stagerun_request_duration_seconds Time to answer a request (whole stream)."
        )
        out.append("# TYPE stagerun_request_duration_seconds histogram")
        for endpoint, hist in sorted(self.durations.items()):
            name = "stagerun_request_duration_seconds"
            for bound, n in zip(hist.buckets, hist.counts, strict=True):
                le = {"endpoint": endpoint, "le": _number(bound)}
                out.append(f"{name}_bucket{_labels(le)} {n}")
            out.append(f"{name}_bucket{_labels({'endpoint': endpoint, 'le': '+Inf'})} {hist.count}")
            out.append(f"{name}_sum{_labels({'endpoint': endpoint})} {_number(hist.total)}")
            out.append(f"{name}_count{_labels({'endpoint': endpoint})} {hist.count}")
        family(
            "stagerun_prompt_tokens_total", "counter", "Prompt tokens processed.",
            [({}, self.prompt_tokens)],
        )  # fmt: skip
        family(
            "stagerun_completion_tokens_total", "counter", "Tokens generated.",
            [({}, self.completion_tokens)],
        )  # fmt: skip
        for name, help_text, hist in (
            ("stagerun_time_to_first_token_seconds", "Prompt to first token (prefill).",
             self.time_to_first_token),
            ("stagerun_decode_seconds", "First token to last token.", self.decode_seconds),
            ("stagerun_running_requests", "Requests running, sampled as each one starts.",
             self.running_at_admission),
        ):  # fmt: skip
            out.extend(hist.lines(name, help_text))
        family(
            "stagerun_prefill_chunks_total", "counter", "Prefill chunks sent through the stages.",
            [({}, self.prefill_chunks)],
        )  # fmt: skip
        family(
            "stagerun_draft_tokens_total", "counter",
            "Draft tokens proposed in verify windows.", [({}, self.draft_tokens)],
        )  # fmt: skip
        family(
            "stagerun_draft_tokens_accepted_total", "counter",
            "Draft tokens the target model accepted.", [({}, self.draft_tokens_accepted)],
        )  # fmt: skip
        family(
            "stagerun_speculation_switched_off_total", "counter",
            "Requests whose drafting was switched off as not paying.",
            [({}, self.windows_switched_off)],
        )  # fmt: skip
        if pipeline is not None:
            family(
                "stagerun_recoveries_total", "counter",
                "Lane failures requests survived by replaying.", [({}, pipeline.recoveries)],
            )  # fmt: skip
            family(
                "stagerun_recovery_failures_total", "counter",
                "Requests that failed because no lane came back.",
                [({}, pipeline.recovery_failures)],
            )  # fmt: skip
            processes = [s for s in pipeline.stages if isinstance(s.process, StageProcess)]
            if processes:
                family(
                    "stagerun_stage_restarts_total", "counter",
                    "Restarts of supervised stage processes.",
                    (({"stage": str(s.index)}, s.process.restarts) for s in processes),
                )  # fmt: skip
                family(
                    "stagerun_stage_process_state", "gauge",
                    "1 for the state each supervised stage process is in (failed: given up "
                    "after too many exits, not restarted again), 0 for the others.",
                    (
                        ({"stage": str(s.index), "state": state}, int(s.process.state == state))
                        for s in processes
                        for state in STATES
                    ),
                )  # fmt: skip
            _tick_families(family, out, pipeline.scheduler)
        if busy is not None:
            family(
                "stagerun_stage_busy_ratio", "gauge",
                "Share of the time since the previous scrape (the first: since the server "
                "started) the stage computed: stage 0's ticks, or a stage process's CPU seconds "
                "per second (above 1 on several threads). No sample for in-process or remote "
                "stages.",
                (({"stage": str(i)}, fraction) for i, fraction in sorted(busy.items())),
            )  # fmt: skip
        family(
            "stagerun_client_disconnects_total", "counter",
            "Generations cancelled because the client went away.", [({}, self.disconnects)],
        )  # fmt: skip
        _admission_families(family, admission)
        if pool is not None:
            family("stagerun_lanes_idle", "gauge", "Idle lanes in the pool.", [({}, pool.idle)])
            family("stagerun_lanes_busy", "gauge", "Lanes lent to requests.", [({}, pool.busy)])
            family(
                "stagerun_lanes_replaced_total", "counter",
                "Lanes closed after a failed or cancelled request and replaced.",
                [({}, pool.replaced)],
            )  # fmt: skip
            family(
                "stagerun_lane_replace_failures_total", "counter",
                "Replacement lanes that could not be connected.", [({}, pool.replace_failures)],
            )  # fmt: skip
        _prefix_families(family, health)
        family(
            "stagerun_stage_up",
            "gauge",
            "1 if the stage (its primary, or a standby) answered a handshake and, for a "
            "supervised stage process, that process is running, else 0.",
            (
                (
                    {"stage": str(h.stage.index), "address": h.primary},
                    1 if is_serving(h) else 0,
                )
                for h in health
            ),
        )
        return "\n".join(out) + "\n"


def _tick_families(
    family: Callable[[str, str, str, Iterable[tuple[Mapping[str, str], float]]], None],
    out: list[str],
    scheduler: TickScheduler,
) -> None:
    """Stage 0's tick counters (through ``family``) and batch size histogram, onto ``out``."""
    family(
        "stagerun_stage0_ticks_total", "counter", "Batched forwards stage 0 computed.",
        [({}, scheduler.ticks)],
    )  # fmt: skip
    family(
        "stagerun_stage0_rows_total", "counter", "Token rows stage 0's ticks computed.",
        [({}, scheduler.rows)],
    )  # fmt: skip
    hist = Histogram.from_counts(scheduler.batch_sizes, BATCH_BUCKETS)
    out.extend(hist.lines("stagerun_stage0_batch_size", "Forwards (requests) per stage 0 tick."))


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


def _prefix_families(
    family: Callable[[str, str, str, Iterable[tuple[Mapping[str, str], float]]], None],
    health: Sequence[StageHealth],
) -> None:
    """Each stage's prefix cache counters, from the probes of this scrape."""
    caches = [(h.stage.index, h.prefix_cache) for h in health if h.prefix_cache is not None]
    for field, kind, help_text in _PREFIX_FAMILIES:
        suffix = "_total" if kind == "counter" else ""
        family(
            f"stagerun_prefix_cache_{field}{suffix}",
            kind,
            help_text + " By stage.",
            (({"stage": str(index)}, getattr(stats, field)) for index, stats in caches),
        )


def _admission_families(
    family: Callable[[str, str, str, Iterable[tuple[Mapping[str, str], float]]], None],
    admission: Admission,
) -> None:
    """The admission gauges: running, queued, refused, and the limits they run within."""
    budget: list[tuple[Mapping[str, str], float]] = []
    if admission.kv_budget is not None:
        budget.append(({}, admission.kv_budget))
    for name, kind, help_text, samples in (
        ("stagerun_requests_in_flight", "gauge", "Requests generating now.",
         [({}, admission.running)]),
        ("stagerun_requests_queued", "gauge", "Requests waiting for a slot and KV budget.",
         [({}, admission.queued)]),
        ("stagerun_requests_rejected_total", "counter",
         "Requests refused with 429 because the queue was full.", [({}, admission.rejected)]),
        ("stagerun_max_batch", "gauge", "Requests that may generate at once (--max-batch).",
         [({}, admission.max_batch)]),
        ("stagerun_kv_reserved_bytes", "gauge",
         "KV cache bytes the running requests have reserved.", [({}, admission.reserved)]),
        ("stagerun_kv_budget_bytes", "gauge",
         "KV cache bytes the running requests may reserve (--kv-budget).", budget),
    ):  # fmt: skip
        family(name, kind, help_text, samples)
