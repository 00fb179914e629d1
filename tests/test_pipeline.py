"""End to end: stages over loopback lanes produce exactly what one stage produces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import stagerun
from stagerun import (
    RecoveryPolicy,
    SamplingParams,
    SupervisionPolicy,
    open_pipeline,
    split_layers,
)
from stagerun._errors import LaneError, StageError
from stagerun.testing import write_tiny_model
from stagerun.transports import parse_address

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=6)


def test_split_layers_is_even_and_contiguous() -> None:
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        split_layers(3, 4)


async def _greedy(
    model: Path | str, stages: int, prompt: str = PROMPT, n: int = 12, **kw: object
) -> list[int]:
    async with open_pipeline(model, stages=stages, **kw) as pipeline:  # type: ignore[arg-type]
        result = await pipeline.complete(prompt, max_tokens=n)
    return result.token_ids


async def test_tiny_model_same_tokens_for_every_split(tiny: Path) -> None:
    reference = await _greedy(tiny, 1)
    assert len(reference) > 0
    for stages in (2, 3, 6):
        assert await _greedy(tiny, stages) == reference, f"{stages} stages differ"


async def test_seeded_sampling_is_reproducible_and_split_invariant(tiny: Path) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    results = []
    for stages in (1, 3):
        async with open_pipeline(tiny, stages=stages) as pipeline:
            results.append(
                (await pipeline.complete(PROMPT, max_tokens=16, sampling=params)).token_ids
            )
    assert results[0] == results[1]


async def test_wire_dtypes_run(tiny: Path) -> None:
    reference = await _greedy(tiny, 1)
    assert await _greedy(tiny, 3, wire_dtype="f16") == reference
    assert len(await _greedy(tiny, 3, wire_dtype="q8")) == len(reference)


async def test_generate_streams_text_and_reuses_lane(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=3) as pipeline:
        pieces: list[str] = []
        async with pipeline.generate(PROMPT, max_tokens=10) as stream:
            async for chunk in stream:
                pieces.append(chunk.text)
        assert stream.result is not None
        assert "".join(pieces) == stream.result.text
        assert stream.result.finish_reason in ("length", "stop")
        assert pipeline.pool is not None and pipeline.pool.replaced == 0
        timings = stream.result.timings
        assert timings["prompt_n"] == len(stream.result.prompt_token_ids)
        assert timings["predicted_n"] == len(stream.result.token_ids)


async def test_leaving_a_stream_early_replaces_its_lane(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=2) as pipeline:
        async with pipeline.generate(PROMPT, max_tokens=50) as stream:
            async for _chunk in stream:
                break
        assert pipeline.pool is not None
        assert pipeline.pool.replaced == 1 and pipeline.pool.busy == 0
        again = await pipeline.complete(PROMPT, max_tokens=4)
        assert len(again.token_ids) >= 1


async def test_long_prompt_is_prefilled_in_chunks(tiny: Path) -> None:
    prompt = " ".join(["lanes carry activations"] * 10)
    reference = await _greedy(tiny, 1, prompt=prompt, n=6)
    assert await _greedy(tiny, 3, prompt=prompt, n=6, prefill_chunk=16) == reference


async def test_bad_request_reports_stage_error(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=2) as pipeline:
        assert pipeline.pool is not None
        with pytest.raises(StageError, match="not configured"):
            async with pipeline.pool.checkout(42) as lane:
                await lane.send(
                    stagerun._proto.Decode(request_id=42, position=0, tokens=(1,)),
                    __import__("numpy").zeros((1, pipeline.config.d_model), "float32"),
                )
                await lane.receive_predictions(42)


async def test_prompt_errors_are_clear(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=1) as pipeline:
        with pytest.raises(ValueError, match="prompt is empty"):
            await pipeline.complete([], max_tokens=4)
        with pytest.raises(ValueError, match="context"):
            await pipeline.complete([1] * (pipeline.config.context_length + 1), max_tokens=4)


async def test_bad_layer_ranges_are_rejected(tiny: Path) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        async with open_pipeline(tiny, layers=[(0, 2), (3, 6)]):
            pass
    with pytest.raises(ValueError, match="must end at"):
        async with open_pipeline(tiny, layers=[(0, 2), (2, 5)]):
            pass


async def test_separate_processes_match_and_a_killed_stage_fails_fast(tiny: Path) -> None:
    """Without restarts or recovery, a dead stage fails the next request in seconds."""
    reference = await _greedy(tiny, 1)
    async with open_pipeline(
        tiny,
        stages=3,
        mode="processes",
        supervision=SupervisionPolicy(restart=False),
        recovery=RecoveryPolicy.disabled(),
    ) as pipeline:
        assert (await pipeline.complete(PROMPT, max_tokens=12)).token_ids == reference
        middle = pipeline.stages[1]
        assert middle.pid is not None and middle.pid != os.getpid()
        os.kill(middle.pid, signal.SIGKILL)
        await trio.sleep(0.2)
        started = time.monotonic()
        with pytest.raises((LaneError, StageError)):
            await pipeline.complete(PROMPT, max_tokens=12)
        assert time.monotonic() - started < 5


def test_cli_generate_json(tiny: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stagerun", "generate", "--model", str(tiny), "--stages", "2",
         "--max-tokens", "5", "--json", PROMPT],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "token_ids", "prompt_token_ids", "timings"}
    assert 1 <= len(result["token_ids"]) <= 5


def test_cli_reports_a_missing_model_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stagerun", "generate", "--model", str(tmp_path / "nope.gguf"), "hi"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.startswith("stagerun: error:") and "nope.gguf" in out.stderr


async def test_a_restarted_stage_serves_the_next_request(tiny: Path) -> None:
    """A stage restarted by someone else (not the supervisor) is picked up too."""
    reference = await _greedy(tiny, 1)
    async with open_pipeline(
        tiny, stages=3, mode="processes", supervision=SupervisionPolicy(restart=False)
    ) as pipeline:
        assert (await pipeline.complete(PROMPT, max_tokens=12)).token_ids == reference
        last = pipeline.stages[2]
        assert last.pid is not None and last.address is not None
        os.kill(last.pid, signal.SIGKILL)
        await trio.sleep(0.2)
        _scheme, _host, port = parse_address(last.address)
        lo, hi = last.layers
        cmd = [sys.executable, "-m", "stagerun", "stage", "--model", str(tiny),
               "--layers", f"{lo}:{hi}", "--index", "2", "--port", str(port)]  # fmt: skip
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(
                lambda task_status: trio.run_process(  # noqa: ASYNC105
                    cmd, stdout=subprocess.PIPE, check=False, task_status=task_status
                )
            )
            assert (await proc.stdout.receive_some(4096)).startswith(b"READY ")
            # Stage 0 sees the dead return connection at checkout, stage 1 sees its dead
            # downstream at Configure; both reconnect and the request succeeds.
            assert (await pipeline.complete(PROMPT, max_tokens=12)).token_ids == reference
            proc.kill()


async def test_health_probes_every_stage(tiny: Path) -> None:
    async with open_pipeline(
        tiny, stages=3, mode="processes", supervision=SupervisionPolicy(restart=False)
    ) as pipeline:
        health = await pipeline.check_health()
        assert [h.state for h in health] == ["ready", "ready", "ready"]
        assert health[1].to_json()["layers"] == list(pipeline.stages[1].layers)
        pid = pipeline.stages[2].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await trio.sleep(0.2)
        health = await pipeline.check_health(timeout=0.5)
        assert [h.state for h in health] == ["ready", "ready", "unreachable"]
        assert "could not connect" in (health[2].error or "")


async def test_joining_remote_stages(tiny: Path, nursery: trio.Nursery) -> None:
    from stagerun.backends import NumpyBackend

    reference = await _greedy(tiny, 1)
    ranges = split_layers(6, 3)
    last = await nursery.start(
        lambda task_status: stagerun.serve_stage(
            NumpyBackend(tiny, ranges[2]), index=2, task_status=task_status
        )
    )
    middle = await nursery.start(
        lambda task_status: stagerun.serve_stage(
            NumpyBackend(tiny, ranges[1]), index=1, downstream=last, task_status=task_status
        )
    )
    async with open_pipeline(tiny, layers=ranges, remote=[middle, last]) as pipeline:
        assert [s.address for s in pipeline.stages] == [None, middle, last]
        assert (await pipeline.complete(PROMPT, max_tokens=12)).token_ids == reference


async def test_hop_delay_emulates_a_wan_link(tiny: Path) -> None:
    reference = await _greedy(tiny, 1, n=6)
    async with open_pipeline(tiny, stages=3, hop_delay_ms=20) as pipeline:
        result = await pipeline.complete(PROMPT, max_tokens=6)
    assert result.token_ids == reference
    # every decode step crosses three delayed hops: 0 -> 1 -> 2 -> 0
    per_token_ms = result.timings["predicted_ms"] / (len(result.token_ids) - 1)
    assert 60 <= per_token_ms < 120
    assert result.timings["prompt_ms"] >= 60 + 2 * 20  # configure ack (2 hops) + prefill
