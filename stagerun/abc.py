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
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import attrs
import trio

from ._errors import ComputeCancelled
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
    "ForwardItem",
    "KVCache",
    "Transport",
    "exports_kv",
    "forward_each",
    "run_batch",
]

ConnectionHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]
"""``handler(stream, peer)``: serves one accepted connection; ``peer`` names the other end."""


class Transport(abc.ABC):
    """Carries lanes between stages: connections chosen by the scheme of a stage's address.

    A connection is a `trio.abc.Stream`. stagerun writes every frame (and each handshake
    message) with exactly one ``send_all`` call, and reads with ``receive_some``, feeding what it
    gets to its frame decoder; so a byte-stream transport (TCP, Unix sockets) passes bytes
    through, and a message transport (websockets) may cut a ``send_all`` into several messages
    (``ws`` sends at most 256 KiB per message, and refuses larger ones) and returns messages,
    or parts of them, from ``receive_some``. ``receive_some`` returns ``b""``
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


@attrs.frozen(eq=False)
class ForwardItem:
    """One session's part of a batched forward (`ComputeBackend.forward_batch`).

    The fields are `ComputeBackend.forward`'s arguments, for one cache: T new positions
    ``position..position+T-1`` from ``tokens`` (first stage) or ``hidden`` (``[T, d_model]``).
    """

    cache: Any
    position: int
    tokens: npt.ArrayLike | Sequence[int] | None = None
    hidden: npt.ArrayLike | None = None
    logits: Literal["last", "all"] = "last"
    should_stop: Callable[[], bool] | None = None

    @property
    def rows(self) -> int:
        """How many positions the item computes."""
        source = self.tokens if self.tokens is not None else self.hidden
        return len(source) if source is not None else 0  # type: ignore[arg-type]


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
        ``[1, vocab]``. ``should_stop()`` is polled before the first layer and between layers
        (or between groups of layers computed as one graph); when it returns True the
        backend trims the cache back to ``position`` and raises
        `stagerun.ComputeCancelled`.
        """

    def forward_batch(
        self, items: Sequence[ForwardItem]
    ) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
        """Run several sessions' forwards as one: a result per item, in order.

        Each item is one `forward` on its own cache (no two items share a cache). A backend
        that batches stacks the items' rows for the projections and the MLP and runs the
        attention per item against its cache; the result of an item must not depend on
        the other items (stagerun promises a request the same output alone or in a batch,
        and `stagerun.testing.check_backend` checks it). An item whose ``should_stop``
        returned True is left at its ``position`` and its result is the
        `stagerun.ComputeCancelled` (the others go on). Any other error fails the whole call.

        The default runs the items one after another through `forward`: correct for every
        backend, with no speed-up.
        """
        return forward_each(self, items)

    def export_kv(self, cache: Any, start: int, stop: int) -> Any:
        """A copy of ``cache``'s keys and values for positions ``start..stop-1``, or None.

        This is what a stage's prefix cache keeps of a block (`import_kv` puts it back into
        another request's cache). The copy must not change when ``cache`` does, and must
        have an ``nbytes`` attribute (the memory it holds). The default returns None: the
        backend keeps no prefix cache, and its stage recomputes every prompt.

        A backend that exports must also compute a row the same whatever chunk it comes in
        (a prompt prefilled in one chunk, in several, or from a restored prefix, gives
        bitwise the same outputs): otherwise a request's output could depend on what the
        cache held. `stagerun.testing.check_backend` checks both.
        """
        return None

    def import_kv(self, cache: Any, blocks: Sequence[Any]) -> None:
        """Fill the empty ``cache`` with ``blocks`` (`export_kv` results, from position 0 on).

        The blocks are consecutive and were exported by a backend with the same layers; the
        cache's length becomes the sum of their positions.
        """
        raise NotImplementedError(f"{type(self).__name__} does not export its KV cache")


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


def forward_each(
    backend: Any, items: Sequence[ForwardItem]
) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
    """The items of a batched forward run one after another through ``backend.forward``."""
    results: list[np.ndarray[Any, Any] | ComputeCancelled] = []
    for item in items:
        try:
            results.append(
                backend.forward(
                    item.cache,
                    item.position,
                    tokens=item.tokens,
                    hidden=item.hidden,
                    logits=item.logits,
                    should_stop=item.should_stop,
                )
            )
        except ComputeCancelled as exc:
            results.append(exc)
    return results


def exports_kv(backend: Any) -> bool:
    """Whether ``backend`` has its own `ComputeBackend.export_kv` (so its stage can cache)."""
    method = getattr(type(backend), "export_kv", None)
    return method is not None and method is not ComputeBackend.export_kv


def run_batch(
    backend: Any, items: Sequence[ForwardItem]
) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
    """``backend.forward_batch(items)`` where it has its own, else `forward_each`.

    A backend's ``forward_batch`` is used only if its class defines it at least as far down
    as ``forward``: a subclass that overrides ``forward`` alone (to wrap or alter it) keeps
    its ``forward`` called, and so does a wrapper that passes attributes on through
    ``__getattr__``, or a plugin written before batched forwards existed.
    """
    kind: type = type(backend)
    if not _batches(kind):  # cached per class: this runs every tick
        return forward_each(backend, items)
    results: list[np.ndarray[Any, Any] | ComputeCancelled] = backend.forward_batch(items)
    if len(results) != len(items):
        raise RuntimeError(
            f"{type(backend).__name__}.forward_batch returned {len(results)} results "
            f"for {len(items)} items"
        )
    return results


@functools.cache
def _batches(cls: type) -> bool:
    """Whether ``cls``'s own ``forward_batch`` is meant for its ``forward``."""
    owner = {
        name: next((c for c in cls.__mro__ if name in vars(c)), None)
        for name in ("forward", "forward_batch")
    }
    batch, forward = owner["forward_batch"], owner["forward"]
    if batch is None or forward is None or batch is ComputeBackend:
        return False
    return issubclass(batch, forward)
