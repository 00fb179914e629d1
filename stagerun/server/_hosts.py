"""Which ``Host`` headers a server answers: `AllowedHosts`, and `split_host` to read one."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

import attrs


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an allow-list entry) as (name, port): lower case, no brackets.

    None when it is not ``name``, ``name:port``, ``[v6]`` or ``[v6]:port``.
    """
    value = value.strip().lower()
    port: str | None = None
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a name, or a bare IPv6 address as an allow-list entry may give it
        name = value
    if port is not None and not (port.isdigit() and len(port) <= 5):
        return None
    name = name.removesuffix(".")  # "localhost." is "localhost"
    if not name or any(c.isspace() or c in "/@?#" for c in name):
        return None
    return name, None if port is None else int(port)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@attrs.frozen
class AllowedHosts:
    """The ``Host`` header values a server answers (see `parse`); the rest get 421.

    A web page can make a browser send requests to a server on ``localhost``, and through DNS
    rebinding even read the answers; the browser then sends the page's own host name. Naming
    the hosts a server answers for stops both.

    Attributes:
        names: host names and addresses answered on any port.
        pairs: (name, port) answered on that port only.
        any_ip: any IP address literal too (a server bound to every address of the machine:
            a rebinding page always names a DNS name, never an address).
        anything: no check at all (the entry ``*``).
    """

    names: frozenset[str] = frozenset()
    pairs: frozenset[tuple[str, int]] = frozenset()
    any_ip: bool = False
    anything: bool = False

    @classmethod
    def parse(cls, entries: Iterable[str], *, any_ip: bool = False) -> AllowedHosts:
        """From entries like ``localhost``, ``api.example.com:443``, ``[::1]``, or ``*``.

        Raises:
            ValueError: an entry is not a host name or address, with an optional port.
        """
        names, pairs, anything = set(), set(), False
        for entry in entries:
            if entry.strip() == "*":
                anything = True
                continue
            split = split_host(entry)
            if split is None:
                raise ValueError(
                    f"{entry!r} is not a host name or address (with an optional :port); "
                    "write e.g. api.example.com, localhost:8000 or [::1]"
                )
            name, port = split
            if port is None:
                names.add(name)
            else:
                pairs.add((name, port))
        return cls(frozenset(names), frozenset(pairs), any_ip, anything)

    def allows(self, host: str) -> bool:
        """Whether a request with this ``Host`` header value is answered."""
        if self.anything:
            return True
        split = split_host(host)
        if split is None:
            return False
        name, port = split
        if name in self.names or (port is not None and (name, port) in self.pairs):
            return True
        return self.any_ip and _is_ip(name)
