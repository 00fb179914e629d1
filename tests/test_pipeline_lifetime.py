"""A pipeline serves the Trio run that opened it, until its block ends, and says so."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from stagerun import PipelineClosedError, open_pipeline
from stagerun.testing import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=4)


@pytest.mark.parametrize("stages", [1, 2])
async def test_a_closed_pipeline_refuses_at_once_and_reports_closed(
    tiny: Path, stages: int
) -> None:
    async with open_pipeline(tiny, stages=stages) as pipeline:
        assert (await pipeline.complete("hi", max_tokens=2)).token_ids
    with trio.fail_after(1):  # at once: no recovery, no waiting for a lane
        with pytest.raises(PipelineClosedError, match="closed"):
            await pipeline.complete("hi", max_tokens=2)
        with pytest.raises(PipelineClosedError, match="closed"):
            async with pipeline.generate("hi", max_tokens=2):
                pass
        health = await pipeline.check_health()
    assert [h.state for h in health] == ["closed"] * stages


async def test_a_pipeline_refuses_another_trio_run(tiny: Path) -> None:
    errors: list[BaseException] = []
    async with open_pipeline(tiny, stages=2) as pipeline:

        def elsewhere() -> None:
            async def use() -> None:
                await pipeline.complete("hi", max_tokens=2)

            try:
                trio.run(use)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=elsewhere)
        await trio.to_thread.run_sync(lambda: (thread.start(), thread.join(10)))
        assert (await pipeline.complete("hi", max_tokens=2)).token_ids  # still fine here
    assert len(errors) == 1 and isinstance(errors[0], PipelineClosedError)
    assert "another trio.run" in str(errors[0])


def test_stage_processes_ignore_the_apps_own_modules(tiny: Path, tmp_path: Path) -> None:
    """A module beside the app named like one a stage imports does not break the stages."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "concurrent.py").write_text("raise ImportError('the app shadows concurrent')\n")
    (app / "main.py").write_text(
        "import trio\n"
        "from stagerun import open_pipeline\n"
        "async def main():\n"
        f"    async with open_pipeline({str(tiny)!r}, stages=2, mode='processes') as p:\n"
        "        print(len((await p.complete('hi', max_tokens=3)).token_ids))\n"
        "trio.run(main)\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "main.py"], cwd=app, capture_output=True, text=True, timeout=120
    )  # the app itself runs with -P too: its own imports would meet its concurrent.py
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3"


async def test_an_app_answers_to_the_name_the_pipeline_was_opened_with(tiny: Path) -> None:
    import httpx

    from stagerun.server import create_app

    async with open_pipeline(tiny) as pipeline:
        app = create_app(pipeline)  # no model_id: the names it was opened as are taken
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            for name in (str(tiny), tiny.name, pipeline.config.name):
                body = {"model": name, "prompt": "hi", "max_tokens": 2}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, (name, response.text)
            unknown = {"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}
            assert (await client.post("/v1/completions", json=unknown)).status_code == 404


async def test_health_reports_each_stages_real_backend(tiny: Path) -> None:
    import httpx

    from stagerun.server import create_app

    async with open_pipeline(tiny, stages=2, backends=["numpy", "fake"]) as pipeline:
        assert [info.backend for info in pipeline.stages] == ["numpy", "fake"]
        transport = httpx.ASGITransport(app=create_app(pipeline))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            stages = (await client.get("/health")).json()["stages"]
    assert [stage["backend"] for stage in stages] == ["numpy", "fake"]


async def test_stage_0_whose_compute_hangs_reports_stalled(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compute thread stuck in stage 0's backend: its health says so (a stage process in
    # that state refuses handshakes: test_hostile_lane.py), and ready again once it moves.
    from stagerun._driver import _pipeline

    monkeypatch.setattr(_pipeline, "STALL_SECONDS", 0.3)
    gate = threading.Event()
    async with open_pipeline(tiny, stages=1) as pipeline:
        backend = pipeline.engine.backend
        computes = backend.forward_batch

        def hanging(items: list[object]) -> object:
            gate.wait(30)
            return computes(items)  # type: ignore[arg-type]

        monkeypatch.setattr(backend, "forward_batch", hanging)
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(pipeline.complete, "hi", max_tokens=2))
                await trio.sleep(0.1)
                assert [h.state for h in await pipeline.check_health()] == ["ready"]
                await trio.sleep(0.5)
                (health,) = await pipeline.check_health()
                assert health.state == "stalled" and not health.available
                assert health.error is not None and "no progress for" in health.error
                gate.set()
            assert [h.state for h in await pipeline.check_health()] == ["ready"]
