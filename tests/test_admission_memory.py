"""Admission by memory: ``--max-batch`` slots and a ``--kv-budget`` of reserved KV cache.

The decisions are pure (`Admission` decides synchronously); the cancellation cases run under
Trio. The server-level tests run a tiny in-process pipeline: through hypercorn for /health and
/metrics, and as a bare ASGI call to see when the ticket is released.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from test_server_app import CHAT, GatedPipeline, http_server, wait_until

from stagerun import open_pipeline
from stagerun._cli._config import config_from_args, max_batch_from_args
from stagerun._cli._options import build_parser
from stagerun._cli._serve import options_from_args
from stagerun.model import open_model
from stagerun.model._gguf import ModelConfig
from stagerun.server import Admission, Ticket, create_app
from stagerun.server._admission import default_kv_budget, kv_bytes_per_token, parameter_count
from stagerun.server._serve import ServeOptions, _checked
from stagerun.testing import write_tiny_model

SMOLLM2 = ModelConfig(
    name="smollm2", architecture="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3,
    head_dim=64, d_ff=1536, vocab_size=49152, rope_base=100000.0, rms_eps=1e-5,
    context_length=8192, tied_output=True, bos_id=1, eos_id=2, eog_ids=frozenset({0, 2}),
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=6)


def admitted(adm: Admission, reserve: int) -> Ticket:
    ticket = adm.try_admit(reserve)
    assert ticket is not None
    return ticket


def states(*tickets: Ticket) -> list[str]:
    return [t.state.value for t in tickets]


# -- the decisions ---------------------------------------------------------------------------


def test_a_request_that_fits_runs_and_reserves_its_bytes() -> None:
    adm = Admission(4, 8, kv_budget=100)
    a, b = admitted(adm, 60), admitted(adm, 40)  # exactly the whole budget
    assert states(a, b) == ["running", "running"]
    assert (adm.running, adm.reserved, adm.queued) == (2, 100, 0)
    assert repr(adm) == "<Admission max_batch=4 running=2 queued=0/8 rejected=0 kv=100/100>"


def test_a_request_waits_for_bytes_even_when_a_slot_is_free() -> None:
    adm = Admission(4, 8, kv_budget=100)
    a = admitted(adm, 70)
    b = admitted(adm, 31)
    assert states(a, b) == ["running", "waiting"]
    assert (adm.running, adm.reserved, adm.queued) == (1, 70, 1)


def test_a_request_waits_for_a_slot_even_when_bytes_are_free() -> None:
    adm = Admission(2, 8, kv_budget=1000)
    a, b, c = admitted(adm, 1), admitted(adm, 1), admitted(adm, 1)
    assert states(a, b, c) == ["running", "running", "waiting"]
    a.release()
    assert c.state.value == "running"
    assert (adm.running, adm.reserved) == (2, 2)


def test_the_line_is_fifo_and_a_small_request_never_overtakes_a_waiting_large_one() -> None:
    adm = Admission(8, 8, kv_budget=100)
    a = admitted(adm, 50)
    large = admitted(adm, 80)
    small = admitted(adm, 10)  # it would fit now, but the large one is first in line
    assert states(a, large, small) == ["running", "waiting", "waiting"]
    assert adm.reserved == 50
    a.release()
    assert states(large, small) == ["running", "running"]
    assert (adm.running, adm.reserved, adm.queued) == (2, 90, 0)


def test_released_bytes_grant_as_many_waiters_as_fit_in_order() -> None:
    adm = Admission(8, 8, kv_budget=100)
    big = admitted(adm, 100)
    waiters = [admitted(adm, 30) for _ in range(4)]
    assert states(*waiters) == ["waiting"] * 4
    big.release()
    assert states(*waiters) == ["running", "running", "running", "waiting"]
    assert (adm.running, adm.reserved, adm.queued) == (3, 90, 1)
    big.release()  # idempotent: nothing given back twice
    assert adm.reserved == 90
    waiters[1].release()
    assert waiters[3].state.value == "running"
    for ticket in waiters:
        ticket.release()
    assert (adm.running, adm.reserved, adm.queued) == (0, 0, 0)


def test_a_full_line_refuses_and_counts_the_refusal() -> None:
    adm = Admission(1, 1, kv_budget=100)
    admitted(adm, 100)
    admitted(adm, 1)
    assert adm.try_admit(1) is None
    assert (adm.running, adm.queued, adm.rejected) == (1, 1, 1)


def test_a_reservation_larger_than_the_whole_budget_never_fits() -> None:
    adm = Admission(4, 8, kv_budget=100)
    assert not adm.never_fits(100)
    assert adm.never_fits(101)
    with pytest.raises(ValueError, match="exceeds the budget"):
        adm.try_admit(101)
    assert (adm.running, adm.queued, adm.rejected) == (0, 0, 0)
    assert not Admission(4, 8).never_fits(10**15)  # no budget: only the slots limit


def test_a_waiter_that_leaves_the_line_lets_the_one_behind_it_run() -> None:
    adm = Admission(8, 8, kv_budget=100)
    admitted(adm, 50)
    large, small = admitted(adm, 80), admitted(adm, 10)
    large.release()  # its client went away while it waited
    assert small.state.value == "running"
    assert (adm.running, adm.reserved, adm.queued) == (2, 60, 0)


def test_each_start_samples_the_requests_running() -> None:
    seen: list[int] = []
    adm = Admission(2, 8, kv_budget=100, on_start=seen.append)
    a, _ = admitted(adm, 10), admitted(adm, 10)
    admitted(adm, 10)
    assert seen == [1, 2]
    a.release()  # the waiter starts: one more sample
    assert seen == [1, 2, 2]


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    adm = Admission(1, 2, kv_budget=100)
    first = admitted(adm, 100)
    gone, kept = admitted(adm, 10), admitted(adm, 10)
    woke: list[str] = []

    async def wait(ticket: Ticket, name: str, task_status: Any) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await ticket.wait()
                woke.append(name)
            finally:
                ticket.release()

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(wait, gone, "gone")
        await nursery.start(wait, kept, "kept")
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert adm.queued == 1 and gone.state.value == "released"
        first.release()
    assert woke == ["kept"]
    assert (adm.running, adm.reserved, adm.queued) == (0, 0, 0)


async def test_a_waiter_granted_as_it_is_cancelled_passes_its_slot_and_bytes_on() -> None:
    adm = Admission(1, 2, kv_budget=100)
    first = admitted(adm, 100)
    granted, behind = admitted(adm, 60), admitted(adm, 70)
    with trio.CancelScope() as scope:
        scope.cancel()
        first.release()  # the slot and the bytes go to `granted`, whose task is cancelled
        assert granted.state.value == "running" and adm.reserved == 60
        try:
            await granted.wait()
        finally:
            granted.release()
    assert behind.state.value == "running"
    assert (adm.running, adm.reserved, adm.queued) == (1, 70, 0)


# -- the budget's size ----------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_matches_the_model_file(tmp_path: Path, tied: bool) -> None:
    model = open_model(write_tiny_model(tmp_path / "m.gguf", n_layers=3, tied_output=tied))
    counted = sum(math.prod(int(n) for n in t.shape) for t in model._reader.tensors)
    assert parameter_count(model.config) == counted


def test_the_default_budget_for_smollm2() -> None:
    assert kv_bytes_per_token(SMOLLM2) == 30 * 2 * 3 * 64 * 4 == 46_080
    assert parameter_count(SMOLLM2) == 134_515_008
    # 16 requests of 1024 tokens outweigh the float32 weights (538,060,032 bytes).
    assert default_kv_budget(SMOLLM2, 16) == 16 * 1024 * 46_080 == 754_974_720
    assert default_kv_budget(SMOLLM2, 4) == 134_515_008 * 4
    small = attrs.evolve(SMOLLM2, d_model=8, vocab_size=8)  # next to no weights
    assert default_kv_budget(small, 1) == 8192 * 46_080  # at least one full context


# -- the command line -----------------------------------------------------------------------


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("text", "size"),
    [("512M", 512 << 20), ("2G", 2 << 30), ("1000", 1000), ("1.5GiB", 3 << 29), ("64kb", 65536)],
)
def test_kv_budget_takes_sizes(text: str, size: int) -> None:
    assert _serve_args("--kv-budget", text).kv_budget == size


@pytest.mark.parametrize("text", ["lots", "2X", "0", "-5M"])
def test_kv_budget_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(SystemExit):
        _serve_args(f"--kv-budget={text}")


def test_serve_defaults_to_16_at_once_64_waiting_and_a_budget_from_the_model() -> None:
    options = options_from_args(_serve_args())
    assert (options.max_batch, options.max_queue, options.kv_budget) == (16, 64, None)
    assert options.pipeline.capacity == 16


def test_parallel_is_a_deprecated_alias_of_max_batch(capsys: pytest.CaptureFixture[str]) -> None:
    args = _serve_args("--parallel", "3")
    assert "--parallel is deprecated; use --max-batch" in capsys.readouterr().err
    assert max_batch_from_args(args) == 3
    assert config_from_args(args).capacity == 3
    options = options_from_args(_serve_args("--max-batch", "5", "--kv-budget", "1G"))
    assert (options.max_batch, options.kv_budget) == (5, 1 << 30)
    with pytest.raises(SystemExit):
        _serve_args("--help")
    assert "deprecated alias of --max-batch" in " ".join(capsys.readouterr().out.split())


def test_bench_load_keeps_its_parallel() -> None:
    args = build_parser().parse_args(["bench", "load", "--parallel", "2"])
    assert max_batch_from_args(args) == 2


def test_the_lane_pool_has_a_lane_for_every_running_request() -> None:
    options = ServeOptions(max_batch=12, pipeline=ServeOptions().pipeline.replace(capacity=4))
    _, wanted, _ = _checked(options)
    assert wanted.capacity == 12
    with pytest.raises(ValueError, match="--max-batch must be at least 1"):
        _checked(ServeOptions(max_batch=0))


# -- the server ------------------------------------------------------------------------------


async def test_health_and_metrics_show_the_batch_and_the_kv_budget(tiny: Path) -> None:
    body = {**CHAT, "max_tokens": 40, "stream": True}
    async with open_pipeline(tiny, stages=3, mode="inproc", capacity=2) as real:
        per_token = kv_bytes_per_token(real.config)
        prompt = len(real.encode_prompt([CHAT["messages"][0]]))
        reserve = (prompt + 40) * per_token
        budget = reserve + reserve // 2  # room for one such request, not two
        async with (
            http_server(gated := GatedPipeline(real), max_queue=4, kv_budget=budget) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            too_long = {**CHAT, "max_tokens": 400}
            refused = await client.post("/v1/chat/completions", json=too_long)
            assert refused.status_code == 400, refused.text
            assert "--kv-budget" in refused.json()["error"]["message"]
            statuses: list[int] = []

            async def post() -> None:
                statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(post)

                async def one_runs_one_waits() -> bool:
                    requests = (await client.get("/health")).json()["requests"]
                    return bool(requests["running"] == 1 and requests["queued"] == 1)

                await wait_until(one_runs_one_waits)  # a free slot, but not the bytes
                health = (await client.get("/health")).json()["requests"]
                assert health == {
                    "running": 1,
                    "queued": 1,
                    "max_batch": 2,
                    "max_queue": 4,
                    "rejected": 0,
                    "kv_reserved_bytes": reserve,
                    "kv_budget_bytes": budget,
                }
                lines = (await client.get("/metrics")).text.splitlines()
                for line in (
                    "stagerun_requests_in_flight 1",
                    "stagerun_requests_queued 1",
                    "stagerun_requests_rejected_total 0",
                    "stagerun_max_batch 2",
                    f"stagerun_kv_reserved_bytes {reserve}",
                    f"stagerun_kv_budget_bytes {budget}",
                    "# TYPE stagerun_running_requests histogram",
                    'stagerun_running_requests_bucket{le="1"} 1',
                    "stagerun_running_requests_count 1",
                ):
                    assert line in lines, line
                gated.gate.set()
            assert statuses == [200, 200]
            lines = (await client.get("/metrics")).text.splitlines()
            assert 'stagerun_running_requests_bucket{le="64"} 2' in lines
            assert "stagerun_kv_reserved_bytes 0" in lines


async def test_a_max_batch_beyond_the_lanes_is_refused(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=2, mode="inproc", capacity=2) as pipeline:
        with pytest.raises(ValueError, match="more than the lane pool's 2 lanes"):
            create_app(pipeline, max_batch=3)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_ticket_is_released_when_generation_ends_before_the_last_write(
    tiny: Path, stream: bool
) -> None:
    async with open_pipeline(tiny, stages=2, mode="inproc", capacity=1) as pipeline:
        app = create_app(pipeline, model_id="tiny")
        admission = app.state.admission  # type: ignore[attr-defined]
        body = json.dumps({**CHAT, "max_tokens": 4, "stream": stream}).encode()
        sent: list[tuple[bool, int]] = []  # (more body to come, requests running) per write
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                sent.append((message.get("more_body", False), admission.running))

        scope = {
            "type": "http", "method": "POST", "path": "/v1/chat/completions",
            "headers": [(b"content-type", b"application/json")], "query_string": b"",
            "root_path": "", "scheme": "http", "server": ("test", 80), "http_version": "1.1",
        }  # fmt: skip
        await app(scope, receive, send)  # type: ignore[arg-type]
        assert sent and sent[-1] == (False, 0)  # the last write found the slot already free
