"""Server metrics and their Prometheus text exposition (format 0.0.4), written by hand.

Counters and the duration histogram live in `Metrics`; gauges (requests in flight, lanes,
stages up) are read from their owners when `/metrics` is scraped, so they are never stale.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from .._lanes import LanePool
from .._pipeline import StageHealth
from ._admission import Admission

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


class Metrics:
    """What the server counts while it runs."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.durations: dict[str, Histogram] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0

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

    def render(
        self,
        *,
        admission: Admission,
        pool: LanePool | None,
        health: Sequence[StageHealth],
    ) -> str:
        """The Prometheus text exposition of everything above plus the live gauges."""
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
        family(
            "stagerun_client_disconnects_total", "counter",
            "Generations cancelled because the client went away.", [({}, self.disconnects)],
        )  # fmt: skip
        family(
            "stagerun_requests_in_flight", "gauge", "Requests generating now.",
            [({}, admission.running)],
        )  # fmt: skip
        family(
            "stagerun_requests_queued", "gauge", "Requests waiting for a slot.",
            [({}, admission.queued)],
        )  # fmt: skip
        family(
            "stagerun_requests_rejected_total", "counter",
            "Requests refused with 429 because the queue was full.", [({}, admission.rejected)],
        )  # fmt: skip
        family(
            "stagerun_admission_capacity", "gauge", "Requests that may generate at once.",
            [({}, admission.capacity)],
        )  # fmt: skip
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
        family(
            "stagerun_stage_up",
            "gauge",
            "1 if the stage answered a handshake, else 0.",
            (
                (
                    {"stage": str(h.stage.index), "address": h.stage.address or "local"},
                    1 if h.state == "ready" else 0,
                )
                for h in health
            ),
        )
        return "\n".join(out) + "\n"
