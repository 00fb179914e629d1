"""`/metrics` as a Prometheus client reads it: the families, their types and a few values.

The exposition is parsed with `prometheus_client`'s own parser, from a real in-process
pipeline behind the HTTP app, and compared with what `generate_latest` makes of the same
registry: the two texts differ only in how numbers are written (``7`` here, ``7.0`` there)
and the order of labels, never in what they say.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from test_metrics_batch import CHAT, http_server

from stagerun import open_pipeline
from stagerun.server._admission import Admission
from stagerun.server._metrics import CONTENT_TYPE, Metrics, text_format

PREFIX_COUNTERS = (
    "hits",
    "misses",
    "hit_tokens",
    "lookup_tokens",
    "stored_blocks",
    "evicted_blocks",
)
# Each family /metrics of an in-process pipeline has, by its name as the parser gives it
# (counters without ``_total``), with its type.
FAMILIES = {
    "stagerun_requests": "counter",
    "stagerun_request_duration_seconds": "histogram",
    "stagerun_prompt_tokens": "counter",
    "stagerun_completion_tokens": "counter",
    "stagerun_time_to_first_token_seconds": "histogram",
    "stagerun_decode_seconds": "histogram",
    "stagerun_running_requests": "histogram",
    "stagerun_prefill_chunks": "counter",
    "stagerun_draft_tokens": "counter",
    "stagerun_draft_tokens_accepted": "counter",
    "stagerun_speculation_switched_off": "counter",
    "stagerun_recoveries": "counter",
    "stagerun_recovery_failures": "counter",
    "stagerun_stage0_ticks": "counter",
    "stagerun_stage0_rows": "counter",
    "stagerun_stage0_batch_size": "histogram",
    "stagerun_stage_busy_ratio": "gauge",
    "stagerun_client_disconnects": "counter",
    "stagerun_requests_in_flight": "gauge",
    "stagerun_requests_queued": "gauge",
    "stagerun_requests_rejected": "counter",
    "stagerun_max_batch": "gauge",
    "stagerun_kv_reserved_bytes": "gauge",
    "stagerun_kv_budget_bytes": "gauge",
    "stagerun_lanes_idle": "gauge",
    "stagerun_lanes_busy": "gauge",
    "stagerun_lanes_replaced": "counter",
    "stagerun_lane_replace_failures": "counter",
    **{f"stagerun_prefix_cache_{field}": "counter" for field in PREFIX_COUNTERS},
    **{f"stagerun_prefix_cache_{field}": "gauge" for field in ("blocks", "bytes", "max_bytes")},
    "stagerun_stage_up": "gauge",
}


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``text``, by name and labels (sorted), as the parser reads it."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_parse_as_prometheus_text(tiny_model_path: Path) -> None:
    async with (
        open_pipeline(tiny_model_path, stages=2, mode="inproc", capacity=1) as pipeline,
        http_server(pipeline) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        reply = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert reply.status_code == 200
        usage = reply.json()["usage"]
        response = await client.get("/metrics")
        assert response.headers["content-type"] == CONTENT_TYPE
        families = {f.name: f for f in text_string_to_metric_families(response.text)}
        assert {name: f.type for name, f in families.items()} == FAMILIES
        samples = {
            (s.name, tuple(s.labels.values())): s.value
            for f in families.values()
            for s in f.samples
        }
        assert samples[("stagerun_requests_total", ("/v1/chat/completions", "200"))] == 1
        duration = ("/v1/chat/completions", "+Inf")
        assert samples[("stagerun_request_duration_seconds_bucket", duration)] == 1
        assert samples[("stagerun_request_duration_seconds_count", duration[:1])] == 1
        assert samples[("stagerun_prompt_tokens_total", ())] == usage["prompt_tokens"]
        assert samples[("stagerun_completion_tokens_total", ())] == usage["completion_tokens"]
        assert samples[("stagerun_stage0_ticks_total", ())] == pipeline.batcher.ticks > 0
        assert samples[("stagerun_requests_in_flight", ())] == 0
        assert samples[("stagerun_lanes_idle", ())] == 1
        assert [s.labels["stage"] for s in families["stagerun_stage_up"].samples] == ["0", "1"]
        assert {s.value for s in families["stagerun_stage_up"].samples} == {1}
        assert samples[("stagerun_kv_reserved_bytes", ())] == 0  # nothing runs
        assert samples[("stagerun_kv_budget_bytes", ())] > 0


def _metrics() -> Metrics:
    metrics = Metrics()
    metrics.observe_request("/v1/completions", 200, 0.2)
    metrics.observe_request('/odd "endpoint"\\\n', 500, 1000.0)
    metrics.observe_tokens(5, 7)
    metrics.observe_timings({"prompt_ms": 180.0, "predicted_ms": 900.0, "draft_n": 3})
    metrics.observe_running(3)
    return metrics


def test_the_text_says_what_generate_latest_says_of_the_same_registry() -> None:
    metrics = _metrics()
    ours = text_format(metrics.registry.collect())  # between scrapes: the counts alone
    theirs = prometheus_client.generate_latest(metrics.registry).decode()
    assert ours != theirs  # "7" against "7.0"
    assert _values(ours) == _values(theirs)
    assert "stagerun_completion_tokens_total 7\n" in ours
    assert 'stagerun_running_requests_bucket{le="4"} 1\n' in ours


def test_each_metrics_has_a_registry_of_its_own() -> None:
    one, two = _metrics(), Metrics()
    admission: Any = Admission(4, 16)
    assert one.registry is not two.registry
    one_text = one.render(admission=admission, pool=None, health=[])
    two_text = two.render(admission=admission, pool=None, health=[])
    assert _values(one_text) != _values(two_text)
    assert one.scrape is None  # the live families are read only while a scrape is written
    assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("stagerun")]
