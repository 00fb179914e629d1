"""TLS lanes: ``tls://`` (TCP) and ``wss://`` (websocket), alone, mixed and with a lane secret;
the certificate's host name is checked, and neither end speaks anything older than TLS 1.2."""

from __future__ import annotations

import contextlib
import functools
import pathlib
import re
import ssl
import warnings
from collections.abc import Callable, Mapping

import pytest
import trio
import trustme

from stagerun import LaneHandshakeError, StageServer, open_pipeline, plugins
from stagerun._proto import Role
from stagerun._wire._auth import SECRET_ENV
from stagerun._wire._connect import open_connection
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile
from stagerun.testing import check_transport
from stagerun.transports import SecureWebSocketTransport, TlsTransport, parse_address
from stagerun.transports._tls import (
    CA_ENV,
    CERT_ENV,
    KEY_ENV,
    TlsStream,
    client_context,
    server_context,
)

PROMPT = "The lighthouse keeper climbed the stairs"


async def _greedy(model: object, **options: object) -> list[int]:
    async with open_pipeline(model, stages=3, **options) as pipeline:  # type: ignore[arg-type]
        first = await pipeline.complete(PROMPT, max_tokens=24)
        second = await pipeline.complete(PROMPT, max_tokens=24)
        assert len(set(first.token_ids)) >= 8  # a varied oracle: a lost token would show
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
        with pytest.raises(
            LaneHandshakeError,
            match=r"TLS handshake with .* failed: its certificate is not trusted",
        ):
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
             "--stages", "3", "--max-tokens", "24", "--json", *extra, PROMPT],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout)["token_ids"])

    secure = generate(
        "--transport", "tls", "--tls-cert", str(tmp_path / "stage.pem"),
        "--tls-ca", str(tmp_path / "ca.pem"),
    )  # fmt: skip
    assert len(set(secure)) >= 8  # a varied oracle: a lost token would show
    assert secure == generate()


# -- hostname verification and the minimum TLS version ------------------------------------------

LIMIT = 30.0  # a real-clock bound on a whole test: failing it means "hung", not "slow"


@pytest.mark.parametrize("scheme", ["tls", "wss"])
@pytest.mark.parametrize(
    ("named", "other"), [("localhost", "127.0.0.1"), ("127.0.0.1", "localhost")]
)
async def test_a_certificate_for_another_host_name_is_refused(
    tiny_model: ModelFile,
    certificates: trustme.CA,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    scheme: str,
    named: str,
    other: str,
) -> None:
    """The stage's certificate, from the trusted CA, names only ``named``: a client that
    dialled the same stage as ``other`` refuses it, one that dialled ``named`` connects."""
    path = tmp_path / "named.pem"
    certificates.issue_cert(named).private_key_and_cert_chain_pem.write_to_path(str(path))
    monkeypatch.setenv(CERT_ENV, str(path))
    server = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=None)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            address: str = await nursery.start(server.serve, f"{scheme}://127.0.0.1:0")
            by_name, by_other = (address.replace("127.0.0.1", host) for host in (named, other))
            lane = await open_connection(
                by_name, role=Role.LANE, connect_timeout=LIMIT, ready_timeout=LIMIT, secret=None
            )
            await lane.aclose_forcefully()
            with pytest.raises(
                LaneHandshakeError,
                match=rf"TLS handshake with {scheme}://{other}:\d+\S* failed: .*"
                rf"not valid for '?{re.escape(other)}",
            ) as refused:
                await open_connection(
                    by_other, role=Role.LANE, connect_timeout=LIMIT, ready_timeout=LIMIT,
                    secret=None,
                )  # fmt: skip
            if scheme == "tls":  # says what to do (wss:// still reports OpenSSL's words)
                assert "connect by a name the certificate lists" in str(refused.value)
            nursery.cancel_scope.cancel()
    assert server.refused == 0  # the client hung up in the TLS handshake, before any hello


def test_both_ends_require_tls_1_2_and_the_client_checks_the_name(certificates: trustme.CA) -> None:
    client, server = client_context(), server_context()
    assert client.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED


def _legacy_context(ca: trustme.CA, *, server_side: bool) -> ssl.SSLContext:
    """A peer that speaks nothing newer than TLS 1.1 (and allows every cipher)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.0 and 1.1 are, rightly
        context.minimum_version = ssl.TLSVersion.TLSv1
        context.maximum_version = ssl.TLSVersion.TLSv1_1
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    if server_side:
        ca.issue_cert("127.0.0.1").configure_cert(context)
    else:
        ca.configure_trust(context)
    return context


def _allowing_tls_1_1(context: ssl.SSLContext) -> ssl.SSLContext:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = ssl.TLSVersion.TLSv1_1
    return context


def _with_any_cipher(make: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    def permissive(environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
        context = make(environ)
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
        return context

    return permissive


@pytest.fixture
def any_cipher(monkeypatch: pytest.MonkeyPatch) -> None:
    """stagerun's TLS contexts, with every cipher allowed (OpenSSL security level 0).

    OpenSSL's default security level refuses TLS 1.1 on its own; at level 0 only a context's
    minimum version stands between it and an old peer, so that is what the tests check.
    """
    from stagerun.transports import _tls

    for name in ("client_context", "server_context"):
        monkeypatch.setattr(_tls, name, _with_any_cipher(getattr(_tls, name)))


async def _serve_raw_tls(nursery: trio.Nursery, context: ssl.SSLContext) -> int:
    """A bare TLS listener on 127.0.0.1 that completes handshakes and holds them; its port."""

    async def handle(tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, context, server_side=True)
        try:
            await stream.do_handshake()
            while await stream.receive_some():
                pass
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def _negotiate(port: int, context: ssl.SSLContext) -> str | None:
    """The TLS version a handshake with 127.0.0.1:``port`` settles on; None if it failed."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="127.0.0.1")
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError:
        await trio.aclose_forcefully(tcp)
        return None
    version = stream.version()
    await trio.aclose_forcefully(stream)
    return version


async def test_a_stage_that_offers_only_tls_1_1_is_refused(
    certificates: trustme.CA, any_cipher: None
) -> None:
    from stagerun.transports._tls import client_context as stagerun_client_context

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await _serve_raw_tls(nursery, _legacy_context(certificates, server_side=True))
            # control: stagerun's client context, its minimum lowered, would settle for 1.1 here
            version = await _negotiate(port, _allowing_tls_1_1(stagerun_client_context()))
            if version is None:
                pytest.skip("this OpenSSL cannot speak TLS 1.1 at all")
            assert version == "TLSv1.1"
            with pytest.raises(
                LaneHandshakeError,
                match=r"TLS handshake with tls://127\.0\.0\.1:\d+ failed: it closed the "
                r"connection \(does it serve TLS 1\.2 or later\?\)",
            ):
                await TlsTransport().connect(f"tls://127.0.0.1:{port}", timeout=LIMIT)
            nursery.cancel_scope.cancel()


async def test_a_client_that_offers_only_tls_1_1_is_refused_by_a_stage(
    tiny_model: ModelFile, certificates: trustme.CA, any_cipher: None
) -> None:
    from stagerun.transports._tls import server_context as stagerun_server_context

    legacy = _legacy_context(certificates, server_side=False)
    server = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=None)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            # control: stagerun's server context, its minimum lowered, would settle for 1.1
            port = await _serve_raw_tls(nursery, _allowing_tls_1_1(stagerun_server_context()))
            version = await _negotiate(port, legacy)
            if version is None:
                pytest.skip("this OpenSSL cannot speak TLS 1.1 at all")
            assert version == "TLSv1.1"
            address: str = await nursery.start(server.serve, "tls://127.0.0.1:0")
            _scheme, _host, stage_port = parse_address(address)
            assert await _negotiate(stage_port, legacy) is None
            # the stage is none the worse: an honest lane connects, over TLS 1.2 or later
            lane = await open_connection(
                address, role=Role.LANE, connect_timeout=LIMIT, ready_timeout=LIMIT, secret=None
            )
            assert isinstance(lane.stream, TlsStream)
            assert lane.stream.inner.version() in ("TLSv1.2", "TLSv1.3")
            await lane.aclose_forcefully()
            nursery.cancel_scope.cancel()


async def test_stalled_tls_handshakes_are_capped_oldest_first(
    certificates: trustme.CA, tiny_model: ModelFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sockets that never start TLS hold at most MAX_HANDSHAKES slots: one more closes the
    oldest at once (not after the 10 s handshake deadline), and an honest lane gets through."""
    from stagerun.transports import _tls

    monkeypatch.setattr(_tls, "MAX_HANDSHAKES", 4)
    server = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=None)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            address: str = await nursery.start(server.serve, "tls://127.0.0.1:0")
            _scheme, host, port = parse_address(address)
            silent = [await trio.open_tcp_stream(host, port) for _ in range(10)]

            async def closed(stream: trio.SocketStream, within: float) -> bool:
                with trio.move_on_after(within):
                    with contextlib.suppress(trio.BrokenResourceError):
                        while await stream.receive_some(4096):
                            pass
                    return True
                return False

            for stream in silent[:6]:  # the oldest six made room for the newest four
                assert await closed(stream, within=2.0)
            for stream in silent[6:]:
                assert not await closed(stream, within=0.05)
            with trio.fail_after(2):
                lane = await open_connection(
                    address, role=Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
                )
            await lane.aclose_forcefully()
            assert await closed(silent[6], within=2.0)  # the honest lane pushed one more out
            for stream in silent:
                await stream.aclose()
            nursery.cancel_scope.cancel()
