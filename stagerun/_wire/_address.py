"""Stage addresses: ``scheme://host:port``, and lists of a primary and its standbys."""

from __future__ import annotations


def parse_address(address: str) -> tuple[str, str, int]:
    """Split ``scheme://host:port`` (scheme optional, default tcp) into its parts.

    Transports whose addresses are a host and a port (tcp, ws) share this parser.

    Raises:
        ValueError: the address has no port or an unknown shape.
    """
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    host, colon, port_text = rest.rpartition(":")
    if not colon or not port_text.isdigit():
        raise ValueError(f"stage address {address!r} must look like {scheme}://HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"stage address {address!r} has port {port} outside 0..65535")
    return scheme, host, port


def format_address(scheme: str, host: str, port: int) -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"
