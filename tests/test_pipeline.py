"""End to end: stages over loopback lanes produce exactly what one stage produces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import trio
from _oracle import assert_varied
from _processes import running

import stagerun
from stagerun import (
    RecoveryPolicy,
    SamplingParams,
    SupervisionPolicy,
    open_pipeline,
    split_layers,
)
from stagerun._errors import LaneError, StageError
from stagerun._wire._connect import stage_reply_timeout
from stagerun.backends import NumpyBackend
from stagerun.testing import write_tiny_model
from stagerun.transports import parse_address

PROMPT = "The quick brown fox"
Activations = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=6)


def test_split_layers_is_even_and_contiguous() -> None:
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        split_layers(3, 4)


async def _wait_until_dead(pid: int) -> None:
    with trio.fail_after(60):  # only a hang fails; SIGKILL normally takes milliseconds
        while running(pid):  # noqa: ASYNC110 (no event tells when another process dies)
            await trio.sleep(0.01)


async def _greedy(
    model: Path | str, stages: int, prompt: str = PROMPT, n: int = 24, **kw: object
) -> list[int]:
    async with open_pipeline(model, stages=stages, **kw) as pipeline:  # type: ignore[arg-type]
        result = await pipeline.complete(prompt, max_tokens=n)
    return result.token_ids


async def test_tiny_model_same_tokens_for_every_split(tiny: Path) -> None:
    reference = await _greedy(tiny, 1)
    assert_varied(reference)
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
    assert_varied(results[0])
    assert results[0] == results[1]


async def test_f16_on_the_wire_gives_the_f32_tokens(tiny: Path) -> None:
    reference = await _greedy(tiny, 1)
    assert_varied(reference)
    assert await _greedy(tiny, 3, wire_dtype="f16") == reference


def _q8_hop(hidden: Activations) -> Activations:
    """One q8 hop, held to the format's bound: half a step of the row's scale on the wire."""
    rows, cols = hidden.shape
    payload = stagerun._proto.encode_activations(hidden, "q8")
    scales = np.frombuffer(payload[: 4 * rows], "<f4")  # max|row| / 127, first in the payload
    decoded = stagerun._proto.decode_activations(payload, "q8", rows, cols)
    row_error = np.abs(decoded - hidden).max(axis=1)
    assert np.all(row_error <= scales * (0.5 + 1e-5) + np.finfo(np.float32).tiny), row_error
    return decoded


async def test_q8_on_the_wire_gives_tokens_within_its_bound_of_f32(tiny: Path) -> None:
    """q8 output compared by value with f32, not only by length.

    The q8 pipeline's tokens are replayed through the same three stages, once with exact hops
    and once with q8 hops (each within half a step of its row's scale). q8 moves the logits by
    ``eps`` (asserted at most 5% of their spread); as the q8 pipeline takes its own argmax, f32
    must rate every q8 token within ``2 * eps`` of its best: so the two agree token for token
    until f32's top two are within ``2 * eps`` of each other.
    """
    async with open_pipeline(tiny, stages=3, wire_dtype="q8") as pipeline:
        q8 = await pipeline.complete(PROMPT, max_tokens=24, ignore_eog=True)
    async with open_pipeline(tiny, stages=1) as pipeline:
        reference = (await pipeline.complete(PROMPT, max_tokens=24, ignore_eog=True)).token_ids
    prompt, tokens = q8.prompt_token_ids, q8.token_ids
    stages = [NumpyBackend(tiny, layers) for layers in split_layers(6, 3)]

    def replay(hop: Callable[[Activations], Activations]) -> Activations:
        hidden = stages[0].forward(stages[0].new_cache(), 0, tokens=[*prompt, *tokens])
        for stage in stages[1:]:
            hidden = stage.forward(stage.new_cache(), 0, hidden=hop(hidden), logits="all")
        return hidden[len(prompt) - 1 : -1]  # row i predicted tokens[i]

    exact, quantized = replay(lambda hidden: hidden), replay(_q8_hop)
    eps = float(np.abs(quantized - exact).max())
    spread = float((exact.max(axis=1) - exact.min(axis=1)).mean())
    assert 0 < eps <= 0.05 * spread, (eps, spread)
    slack = 1e-3  # one-row decode steps vs this batched replay: float32 summation order
    shortfall = exact.max(axis=1) - exact[np.arange(len(tokens)), tokens]
    assert np.all(shortfall <= 2 * eps + slack), (shortfall, eps)
    agree = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), 24)
    if agree < 24:  # the rows up to here replay the f32 run's own prefix
        second, best = np.sort(exact[agree])[-2:]
        assert best - second <= 2 * eps + slack, (agree, best - second, eps)


async def test_a_stop_string_in_the_middle_of_the_output_cuts_it_there(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=2) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=48, ignore_eog=True)
        text = plain.text
        # a two-character stop first seen a third of the way in, well before the end
        stop, at = next(
            (text[i : i + 2], i)
            for i in range(len(text) // 3, 2 * len(text) // 3)
            if text.find(text[i : i + 2]) == i and "\ufffd" not in text[i : i + 2]
        )
        assert at > 0 and at + len(stop) < len(text), (text, stop)
        pieces: list[str] = []
        stopped = await pipeline.complete(
            PROMPT,
            max_tokens=48,
            ignore_eog=True,
            stop=[stop],
            on_token=lambda chunk: pieces.append(chunk.text),
        )
    assert stopped.text == "".join(pieces) == text[:at]  # what precedes the stop is kept
    assert stopped.finish_reason == "stop"
    # what follows is cut: generation ended at the token completing the stop string
    assert stopped.token_ids == plain.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(plain.token_ids)


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
        assert (await pipeline.complete(PROMPT, max_tokens=24)).token_ids == reference
        middle = pipeline.stages[1]
        assert middle.pid is not None and middle.pid != os.getpid()
        os.kill(middle.pid, signal.SIGKILL)
        await _wait_until_dead(middle.pid)
        started = trio.current_time()
        with pytest.raises((LaneError, StageError)):
            await pipeline.complete(PROMPT, max_tokens=12)
        # fast: the lost connection is seen, not waited out until the reply timeout (30 s)
        assert trio.current_time() - started < stage_reply_timeout() / 2


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
        [sys.executable, "-m", "stagerun", "generate", "--model", str(tmp_path / "nope.gguf"), "hi"],  # noqa: E501
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.startswith("stagerun: error:") and "nope.gguf" in out.stderr


async def test_a_restarted_stage_serves_the_next_request(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage restarted by someone else (not the supervisor) is picked up too, when it holds
    the lane secret (without one from the user the stages get their own, and stage 0 refuses
    a stranger on a dead stage's port: tests/test_hostile_supervision.py)."""
    secret = tmp_path / "lane.secret"
    secret.write_bytes(os.urandom(16).hex().encode())
    secret.chmod(0o600)
    monkeypatch.setenv("STAGERUN_SECRET_FILE", str(secret))  # the hand-started stage's too
    reference = await _greedy(tiny, 1)
    async with open_pipeline(
        tiny, stages=3, mode="processes", supervision=SupervisionPolicy(restart=False)
    ) as pipeline:
        assert (await pipeline.complete(PROMPT, max_tokens=24)).token_ids == reference
        last = pipeline.stages[2]
        assert last.pid is not None and last.address is not None
        os.kill(last.pid, signal.SIGKILL)
        await _wait_until_dead(last.pid)  # and so its port is free again
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
            assert (await pipeline.complete(PROMPT, max_tokens=24)).token_ids == reference
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
        await _wait_until_dead(pid)
        # a dead stage refuses the connection at once; the timeout only has to let the live
        # stages answer on a busy machine
        health = await pipeline.check_health(timeout=10)
        assert [h.state for h in health] == ["ready", "ready", "unreachable"]
        assert "could not connect" in (health[2].error or "")


async def test_joining_remote_stages(tiny: Path, nursery: trio.Nursery) -> None:
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
        assert (await pipeline.complete(PROMPT, max_tokens=24)).token_ids == reference


async def test_hop_delay_emulates_a_wan_link(tiny: Path) -> None:
    delay_ms = 50
    # 16 tokens: the first decode steps after the prefill cost about two delays more than the
    # steady ones (measured: 4.8 delays a step over 5 steps, 4.0 over 19), which put 6 tokens
    # within a few milliseconds of the bound below on an idle machine.
    reference = await _greedy(tiny, 1, n=16)
    async with open_pipeline(tiny, stages=3) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=16)
    async with open_pipeline(tiny, stages=3, hop_delay_ms=delay_ms) as pipeline:
        result = await pipeline.complete(PROMPT, max_tokens=16)
    assert result.token_ids == plain.token_ids == reference

    def per_token_ms(completion: stagerun.Completion) -> float:
        return completion.timings["predicted_ms"] / (len(completion.token_ids) - 1)

    # Every decode step crosses three delayed hops, 0 -> 1 -> 2 -> 0: at least three delays
    # (no load makes a sleep shorter), and over the same steps without the delay, measured
    # alongside, fewer than five (a hop delayed twice would add six).
    assert per_token_ms(result) >= 3 * delay_ms
    assert per_token_ms(result) - per_token_ms(plain) < 5 * delay_ms, (
        result.timings,
        plain.timings,
    )
    assert result.timings["prompt_ms"] >= 5 * delay_ms  # configure ack (2 hops) + prefill (3)
