"""Transports that carry stagerun lanes (plugins; see `stagerun.abc.Transport`)."""

from .._wire._address import format_address as format_address
from .._wire._address import parse_address as parse_address
from ._tcp import TcpTransport as TcpTransport
from ._tls import TlsTransport as TlsTransport
from ._websocket import SecureWebSocketTransport as SecureWebSocketTransport
from ._websocket import WebSocketTransport as WebSocketTransport

__all__ = [
    "SecureWebSocketTransport",
    "TcpTransport",
    "TlsTransport",
    "WebSocketTransport",
    "format_address",
    "parse_address",
]
