"""``stagerun serve``'s HTTP options: who may use the server, and what a client may hold.

Each flag is a field of `stagerun.server.HttpConfig` (checked there; mapped in `._serve`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def http_options(serve: argparse.ArgumentParser, seconds: Callable[[str], float]) -> None:
    """Add the HTTP server's options to ``serve``; ``seconds`` parses a duration."""
    from ..server._config import (  # here: the other commands need not import the server
        DEFAULT_BODY_TIMEOUT,
        DEFAULT_REQUEST_TIMEOUT,
        DEFAULT_WRITE_TIMEOUT,
        METRICS_AUTHS,
        PREFIX_SHARES,
    )

    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*; every "
        "user of this machine can read it in the process list, so prefer --api-key-file or "
        "$STAGERUN_API_KEY (an empty key is an error)"
    )  # fmt: skip
    serve.add_argument(
        "--api-key-file", default=None, metavar="PATH",
        help="require an API key from PATH: one key per line (one per tenant; # starts a "
        "comment line), the file private to this user: chmod 600 (default "
        "$STAGERUN_API_KEY_FILE)",
    )  # fmt: skip
    serve.add_argument(
        "--prefix-share", choices=PREFIX_SHARES, default="client",
        help="whose cached prompt prefixes a request reuses: 'client' (default) those of "
        "requests with the same API key, or from the same IP address on a server without "
        "keys; 'global' everyone's, which lets a client tell from the time to first token "
        "or prefix_cached_tokens what others sent",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-auth", choices=METRICS_AUTHS, default="key",
        help="'key' (default): with API keys, /metrics and the detailed /health need one and "
        "others get /health's status alone; 'none': open to everyone",
    )  # fmt: skip
    serve.add_argument(
        "--no-ui", action="store_true",
        help="do not serve the web page at / (a chat with the model and a live view of the "
        "pipeline)",
    )  # fmt: skip
    serve.add_argument(
        "--allowed-hosts", default=None, metavar="HOSTS",
        help="more Host headers to answer, comma-separated (api.example.com, name:port, or * "
        "for any); always answered: the --host address, localhost, 127.0.0.1, [::1], and, "
        "beyond loopback, this machine's host name (and, bound to 0.0.0.0 or ::, any IP address)",
    )  # fmt: skip
    serve.add_argument(
        "--request-timeout", type=seconds, default=DEFAULT_REQUEST_TIMEOUT, metavar="SECS",
        help="the most a generation request may take from its arrival, queue wait included; "
        f"then 504 (default {DEFAULT_REQUEST_TIMEOUT:g})",
    )  # fmt: skip
    serve.add_argument(
        "--write-timeout", type=seconds, default=DEFAULT_WRITE_TIMEOUT, metavar="SECS",
        help="a client that takes none of its answer for SECS loses its request and its "
        f"connection (default {DEFAULT_WRITE_TIMEOUT:g})",
    )  # fmt: skip
    serve.add_argument(
        "--body-timeout", type=seconds, default=DEFAULT_BODY_TIMEOUT, metavar="SECS",
        help=f"a request body must arrive within SECS, else 408 (default {DEFAULT_BODY_TIMEOUT:g})",
    )  # fmt: skip
    serve.add_argument(
        "--max-connections", type=int, default=None, metavar="N",
        help="HTTP connections open at once; beyond, the longest idle one is closed, and when "
        "none is idle a new one gets 503 (GET /health still gets a liveness answer) (default: "
        "what the open-file limit leaves room for, at most 1024)",
    )  # fmt: skip
    serve.add_argument(
        "--max-connections-per-client", type=int, default=None, metavar="N",
        help="of those, from one IP address (an IPv6 /64); beyond, that client's longest idle "
        "one is closed; behind a proxy, raise it (default: a quarter of --max-connections)",
    )  # fmt: skip
    serve.add_argument(
        "--max-bodies-per-client", type=int, default=None, metavar="N",
        help="request bodies from one IP address still arriving 0.25 s after their request "
        "began; one more is answered 429 and its connection closed (default: half of "
        "--max-connections-per-client, at most 16)",
    )  # fmt: skip
