"""The interfaces a stagerun plugin implements: `Transport`, `ComputeBackend` and `Drafter`.

A plugin is a class registered under an entry point group of its distribution::

    [project.entry-points."stagerun.transports"]
    unix = "stagerun_unix:UnixTransport"

``stagerun.transports`` holds transports, ``stagerun.backends`` compute backends and
``stagerun.drafters`` drafters; the entry point's name is the plugin's name. stagerun's own
``tcp``, ``ws``, ``numpy``, ``ngram``, ``draft-model`` and ``oracle`` are registered the same
way. When a plugin is loaded, stagerun checks its shape (see `stagerun.plugins`): subclassing
these ABCs is the easy way to get it right, but any class with the same members passes.

Test a plugin with the conformance suites in `stagerun.testing` (`check_transport`,
`check_backend`, `check_drafter`); docs/plugins.md walks through writing, registering, testing
and shipping one.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import trio

from ._wire._address import parse_address

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from .model import ModelFile

__all__ = [
    "ComputeBackend",
    "ConnectionHandler",
    "Drafter",
    "DrafterOptions",
    "KVCache",
    "Transport",
]

ConnectionHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]
"""``handler(stream, peer)``: serves one accepted connection; ``peer`` names the other end."""


class Transport(abc.ABC):
    """Carries lanes between stages: connections chosen by the scheme of a stage's address.

    A connection is a `trio.abc.Stream`. stagerun writes every frame (and each handshake
    message) with exactly one ``send_all`` call, and reads with ``receive_some``, feeding what it
    gets to its frame decoder; so a byte-stream transport (TCP, Unix sockets) passes bytes
    through, and a message transport (websockets) sends each ``send_all`` as one message and
    returns messages, or parts of them, from ``receive_some``. ``receive_some`` returns ``b""``
    once the peer closed the connection, and must be cancel-safe (cancelled, it loses no data).

    A stream may also have an ``is_live() -> bool`` method, called on idle pooled connections
    before reuse: False when the peer has gone or unsolicited bytes wait. Streams with a
    ``socket`` attribute (trio's SocketStream) are probed with a non-blocking peek instead.
    Otherwise a connection is assumed live, and a dead one is found at first use.

    stagerun builds a transport with no arguments (``Transport()``), once per use; keep
    configuration in the address or in environment variables.
    """

    schemes: ClassVar[tuple[str, ...]]
    """The address schemes served, e.g. ``("tcp",)``; an address looks like ``scheme://...``."""

    def local_address(self, host: str) -> str:
        """An address for a stage started on this machine to listen on.

        Used when stagerun starts stages itself (``--transport NAME``). The default,
        ``SCHEME://HOST:0``, lets the transport pick a free port; a transport whose addresses
        are not host:port (a Unix socket path) overrides it.
        """
        return f"{self.schemes[0]}://{host}:0"

    def check_address(self, address: str) -> None:
        """Raise `ValueError`, saying what an address looks like, unless ``address`` is one.

        Topology files and command-line options are checked with the transport that owns the
        address's scheme, before anything connects. The default accepts ``SCHEME://HOST:PORT``;
        a transport whose addresses are something else (a Unix socket path) overrides it.
        """
        parse_address(address)

    @abc.abstractmethod
    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        """Open a connection to ``address`` within ``timeout`` seconds.

        Raises:
            LaneHandshakeError: the connection could not be opened (say why, name the address).
        """

    @abc.abstractmethod
    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``address`` and run ``handler(stream, peer)`` for each connection.

        Each connection runs in its own task; the handler owns the stream (it closes it).
        Once listening, report the address clients should dial with
        ``task_status.started(address)`` (port 0 becomes the port really bound), then serve
        until cancelled.
        """


class KVCache(Protocol):
    """A backend's per-request cache: positions ``0..length-1`` are filled."""

    @property
    def length(self) -> int: ...

    def trim(self, position: int) -> None:
        """Forget positions at and after ``position`` (no-op past the end)."""


class ComputeBackend(abc.ABC):
    """Runs one stage's contiguous layer range of a model: plain blocking code, no Trio.

    stagerun constructs a backend as ``Backend(model, layers, threads=threads)``: ``model``
    an open `stagerun.model.ModelFile`, ``layers`` the half-open ``(lo, hi)`` range, and
    ``threads`` the compute threads to use (None: the backend decides). ``forward`` is called
    from one worker thread at a time.
    """

    @abc.abstractmethod
    def __init__(
        self, model: ModelFile, layers: tuple[int, int] | None = None, *, threads: int | None = None
    ) -> None: ...

    @property
    @abc.abstractmethod
    def layers(self) -> tuple[int, int]:
        """The ``(lo, hi)`` layer range this backend runs."""

    @property
    @abc.abstractmethod
    def is_first(self) -> bool:
        """This stage takes token ids (it owns the embeddings)."""

    @property
    @abc.abstractmethod
    def is_last(self) -> bool:
        """This stage returns logits (it owns the output norm and head)."""

    @abc.abstractmethod
    def new_cache(self) -> KVCache:
        """An empty cache for one request."""

    @abc.abstractmethod
    def forward(
        self,
        cache: Any,
        position: int,
        *,
        tokens: npt.ArrayLike | Sequence[int] | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Run the layers on T new positions ``position..position+T-1``.

        The first stage takes ``tokens`` (T ids), the others ``hidden`` (``[T, d_model]``). A
        cache longer than ``position`` is trimmed first. Returns float32 hidden states
        ``[T, d_model]``, or on the last stage logits ``[T, vocab]`` (``logits="all"``) or
        ``[1, vocab]``. ``should_stop()`` is polled between layers; when it returns True the
        backend trims the cache back to ``position`` and raises
        `stagerun.ComputeCancelled`.
        """


class DrafterOptions(Protocol):
    """What a drafter may be built from (see `Drafter.create`)."""

    @property
    def target(self) -> ModelFile:
        """The target model (its vocabulary and tokenizer)."""

    @property
    def draft_model(self) -> str | None:
        """A second model named by the user (``--draft-model``), if any."""


class Drafter(abc.ABC):
    """Proposes draft tokens; the target verifies every one. Plain blocking code.

    Class attributes:
        blocking: False when ``propose`` takes microseconds (it is then called on the Trio
            thread); True (the default) runs it in a worker thread.
        per_request: True (the default) creates one drafter per request with `create`;
            False creates one per pipeline and shares it between requests (then it must
            tolerate calls from several requests, one at a time).
    """

    blocking: ClassVar[bool] = True
    per_request: ClassVar[bool] = True

    @classmethod
    def create(cls, options: DrafterOptions) -> Drafter:
        """Build a drafter for a pipeline (the default calls ``cls()``)."""
        return cls()

    @abc.abstractmethod
    def begin(self, prompt: Sequence[int]) -> None:
        """A request starts with this prompt."""

    @abc.abstractmethod
    def commit(self, tokens: Sequence[int]) -> None:
        """These tokens were committed (the target's own)."""

    @abc.abstractmethod
    def propose(self, context: Sequence[int], max_tokens: int) -> Sequence[int]:
        """Up to ``max_tokens`` guesses for the tokens that follow ``context``."""
