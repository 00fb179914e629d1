"""Lanes over TLS: ``tls://HOST:PORT`` is TCP wrapped in `trio.SSLStream`.

Theory of operation: the server side needs a certificate and its key, the client side the
certificate authorities it trusts, both from the environment (``stagerun stage``/``serve`` set
them from ``--tls-cert``, ``--tls-key`` and ``--tls-ca``):

==========================  ==========================================================
``STAGERUN_TLS_CERT``       PEM certificate (chain) a stage serves ``tls://`` lanes with
``STAGERUN_TLS_KEY``        its private key (PEM); default: the certificate file
``STAGERUN_TLS_CA``         PEM bundle a connecting stage trusts; default: the system's
==========================  ==========================================================

The client checks the certificate against the host in the address (an IP address needs an IP
subjectAltName) and requires TLS 1.2 at least; so does the server, so a peer that offers only
TLS 1.1 or older gets no handshake either way. A failed check is one sentence that names the
address and what to fix (`handshake_failure`). TLS protects the activations and tokens on the
wire; the lane secret (`stagerun._wire._auth`) still decides who may connect, and works over TLS
unchanged.

The server sends no TLS 1.3 session tickets (``num_tickets = 0``): a pooled lane is declared
dead when unsolicited bytes wait on its socket, and a ticket arriving after the handshake
would be exactly that. `TlsStream.is_live` checks both the socket and what the TLS layer has
already decrypted.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from functools import partial
from typing import ClassVar

import trio

from .._errors import LaneHandshakeError
from .._wire._address import format_address, parse_address
from .._wire._framed import socket_is_idle
from ..abc import ConnectionHandler, Transport
from ._slots import Slots
from ._tcp import open_tcp

__all__ = ["TlsStream", "TlsTransport", "client_context", "server_context"]

CERT_ENV = "STAGERUN_TLS_CERT"
KEY_ENV = "STAGERUN_TLS_KEY"
CA_ENV = "STAGERUN_TLS_CA"
HANDSHAKE_SECONDS = 10.0
# TLS handshakes in progress at once on a stage, at most; one more closes the oldest. An honest
# handshake takes a round trip or two, so a flood of silent sockets holds this many, each for
# at most HANDSHAKE_SECONDS (the stage's own limits count a connection once TLS is up).
MAX_HANDSHAKES = 64
# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH = (62, 64)


def server_context(environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The server-side context from ``$STAGERUN_TLS_CERT`` / ``$STAGERUN_TLS_KEY``.

    Raises:
        ValueError: no certificate configured, or it cannot be loaded.
    """
    env = os.environ if environ is None else environ
    cert = env.get(CERT_ENV)
    if not cert:
        raise ValueError(
            f"a tls:// stage needs a certificate: --tls-cert FILE (or ${CERT_ENV}) and its key"
        )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.num_tickets = 0
    try:
        context.load_cert_chain(cert, env.get(KEY_ENV) or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert}: {exc}") from None
    return context


def client_context(environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The client-side context: trusts ``$STAGERUN_TLS_CA`` (or the system's authorities).

    Raises:
        ValueError: the CA file cannot be loaded.
    """
    env = os.environ if environ is None else environ
    ca = env.get(CA_ENV)
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS authorities {ca}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def handshake_failure(where: str, host: str, exc: BaseException) -> str:
    """The sentence for a client-side TLS handshake with ``where`` (for ``host``) that failed."""
    cause = exc.__cause__ or exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        if cause.verify_code in _NAME_MISMATCH:
            return (
                f"TLS handshake with {where} failed: its certificate is not valid for {host}; "
                "connect by a name the certificate lists, or give the stage a certificate "
                f"for {host}"
            )
        return (
            f"TLS handshake with {where} failed: its certificate is not trusted "
            f"({cause.verify_message}); give the authority that issued it with --tls-ca"
        )
    if isinstance(cause, ssl.SSLEOFError):
        return (
            f"TLS handshake with {where} failed: it closed the connection "
            "(does it serve TLS 1.2 or later?)"
        )
    return f"TLS handshake with {where} failed: {cause}"


class TlsStream(trio.abc.Stream):
    """A `trio.SSLStream` that can tell whether an idle lane is still sound (`is_live`)."""

    def __init__(self, inner: trio.SSLStream[trio.SocketStream]) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def socket(self) -> trio.socket.SocketType:
        """The TCP socket under the TLS layer."""
        return self.inner.transport_stream.socket

    def is_live(self) -> bool:
        """False when the peer closed, or anything (decrypted or not) waits unread."""
        ssl_object = getattr(self.inner, "_ssl_object", None)
        if ssl_object is not None and ssl_object.pending():
            return False
        return socket_is_idle(self.inner.transport_stream.socket)


class TlsTransport(Transport):
    """Lanes over TLS on TCP: ``tls://HOST:PORT``."""

    schemes: ClassVar[tuple[str, ...]] = ("tls",)

    def __repr__(self) -> str:
        return "<TlsTransport>"

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        """Connect and complete the TLS handshake within ``timeout`` seconds."""
        _scheme, host, port = parse_address(address)
        where = format_address("tls", host, port)
        context = client_context()
        try:
            with trio.fail_after(timeout):
                tcp = await open_tcp(host, port)
                stream = trio.SSLStream(tcp, context, server_hostname=host)
                try:
                    await stream.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
        except trio.TooSlowError as exc:
            raise LaneHandshakeError(
                f"could not connect to {where} (TLS) within {timeout:g}s"
            ) from exc
        except trio.BrokenResourceError as exc:
            raise LaneHandshakeError(handshake_failure(where, host, exc)) from exc
        except OSError as exc:
            raise LaneHandshakeError(
                f"could not connect to {where}: {exc.strerror or exc}"
            ) from exc
        return TlsStream(stream)

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept TLS connections; a failed TLS handshake ends only that connection."""
        _scheme, host, port = parse_address(address)
        context = server_context()
        handshaking = Slots(MAX_HANDSHAKES, "TLS handshakes")

        async def handle(tcp: trio.SocketStream) -> None:
            try:
                peer_host, peer_port = tcp.socket.getpeername()[:2]
                peer = format_address("tls", peer_host, peer_port)
            except OSError:
                peer = "tls://<unknown>"
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            stream = trio.SSLStream(tcp, context, server_side=True)
            done = False
            with handshaking.slot(peer):  # cancelled to make room for a newer handshake
                try:
                    with trio.fail_after(HANDSHAKE_SECONDS):
                        await stream.do_handshake()
                    done = True
                except (trio.TooSlowError, trio.BrokenResourceError, OSError):
                    pass
            if not done:
                await trio.aclose_forcefully(tcp)
                return
            await handler(TlsStream(stream), peer)

        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.serve_listeners, handle, listeners))
            task_status.started(format_address("tls", bound_host, bound_port))
