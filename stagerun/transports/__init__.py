"""Transports that carry stagerun lanes."""

from ._tcp import TcpTransport as TcpTransport
from ._tcp import format_address as format_address
from ._tcp import parse_address as parse_address

__all__ = ["TcpTransport", "format_address", "parse_address"]
