"""TLS lanes: ``tls://`` (TCP) and ``wss://`` (websocket), alone, mixed and with a lane secret."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import trustme

from stagerun import LaneHandshakeError, open_pipeline, plugins
from stagerun._auth import SECRET_ENV
from stagerun._lanes import open_connection
from stagerun._proto import Role
from stagerun.testing import check_transport
from stagerun.transports import SecureWebSocketTransport, TlsTransport
from stagerun.transports._tls import CA_ENV, CERT_ENV, KEY_ENV

PROMPT = "The lighthouse keeper climbed the stairs"


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


async def _greedy(model: object, **options: object) -> list[int]:
    async with open_pipeline(model, stages=3, **options) as pipeline:  # type: ignore[arg-type]
        first = await pipeline.complete(PROMPT, max_tokens=12)
        second = await pipeline.complete(PROMPT, max_tokens=12)
        assert second.token_ids == first.token_ids
        if pipeline.pool is not None:  # the idle TLS lane was reused, not declared dead
            assert pipeline.pool.replaced == 0 and pipeline.pool.replace_failures == 0
        return first.token_ids


def test_tls_transports_are_registered() -> None:
    plugins.refresh()
    assert isinstance(plugins.transport("tls"), TlsTransport)
    assert isinstance(plugins.transport("wss"), SecureWebSocketTransport)


async def test_tls_transports_pass_the_conformance_suite(certificates: trustme.CA) -> None:
    await check_transport(TlsTransport(), "tls://127.0.0.1:0")
    await check_transport(SecureWebSocketTransport(), "wss://127.0.0.1:0")


@pytest.mark.parametrize(
    "options",
    [{"transport": "tls"}, {"transport": "wss"}, {"transports": ["tls", "tcp"]}],
    ids=["tls", "wss", "tls,tcp"],
)
async def test_pipelines_over_tls_generate_the_same_tokens(
    tiny_model_path: pathlib.Path, certificates: trustme.CA, options: dict[str, object]
) -> None:
    assert await _greedy(tiny_model_path, **options) == await _greedy(tiny_model_path)


async def test_tls_and_a_lane_secret_together(
    tiny_model_path: pathlib.Path, certificates: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "a shared secret of some length")
    assert await _greedy(tiny_model_path, transport="tls") == await _greedy(tiny_model_path)


async def test_an_untrusted_certificate_is_refused(
    tiny_model_path: pathlib.Path,
    certificates: trustme.CA,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
) -> None:
    async with open_pipeline(tiny_model_path, stages=2, transport="tls") as pipeline:
        address = pipeline.stages[1].address
        assert address is not None and address.startswith("tls://")
        other = trustme.CA()
        other.cert_pem.write_to_path(str(tmp_path / "other.pem"))
        monkeypatch.setenv(CA_ENV, str(tmp_path / "other.pem"))
        with pytest.raises(LaneHandshakeError, match=r"TLS handshake with .* failed"):
            await open_connection(address, role=Role.LANE, connect_timeout=5, ready_timeout=5)
        # a plain TCP client gets no stagerun handshake from a TLS port either
        with pytest.raises(LaneHandshakeError):
            await open_connection(
                address.replace("tls://", "tcp://"),
                role=Role.LANE,
                connect_timeout=2,
                ready_timeout=2,
            )


def test_a_tls_stage_without_a_certificate_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stagerun.transports._tls import server_context

    monkeypatch.delenv(CERT_ENV, raising=False)
    with pytest.raises(ValueError, match="needs a certificate: --tls-cert"):
        server_context()


def test_the_command_line_takes_the_certificates(
    tiny_model_path: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stagerun generate --transport tls --tls-cert --tls-ca`: stage processes over TLS."""
    import json
    import subprocess
    import sys

    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "stage.pem")
    )
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    for variable in (CERT_ENV, KEY_ENV, CA_ENV):
        monkeypatch.delenv(variable, raising=False)

    def generate(*extra: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-m", "stagerun", "generate", "--model", str(tiny_model_path),
             "--stages", "3", "--max-tokens", "8", "--json", *extra, PROMPT],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout)["token_ids"])

    secure = generate(
        "--transport", "tls", "--tls-cert", str(tmp_path / "stage.pem"),
        "--tls-ca", str(tmp_path / "ca.pem"),
    )  # fmt: skip
    assert secure == generate()
