"""Admission by memory: at most ``max_batch`` requests generate at once, within a KV budget.

Theory of operation: before a request can be priced it must be tokenized, and tokenizing (and
rendering a chat template) is CPU work that must not run on the event loop: `Admission.tokenize`
runs it in one of a few worker threads (``tokenizer_threads``), and a bounded number of
requests (``max_tokenizing``) may be in that line at once; beyond that it refuses too. Text
reaches it only once `prompt_char_limit` has bounded it by the model's context, so each job is
short.

Then (decide, then do): `Admission.try_admit` decides synchronously whether the request runs
now, waits in line, or is refused (the handler answers 429 with ``Retry-After``). A request
reserves the KV cache it can grow to, (prompt tokens + its ``max_tokens``) x
`kv_bytes_per_token`, for as long as it runs; it runs when fewer than ``max_batch`` run and the
reservation fits what is left of ``kv_budget``. Only a waiting request then awaits, in
`Ticket.wait`.

The line is FIFO with head-of-line blocking: a finished request gives back its slot and its
bytes, and the line's head is granted first; while the head does not fit, nobody behind it
runs, so a large request is never starved by a stream of small ones, and a newcomer never
jumps the line. A reservation larger than the whole budget could never run: the handler asks
`Admission.never_fits` first and refuses it at once. A waiter that is cancelled (its client
went away) leaves the line, which may let the ones behind it run; one that was granted at the
moment it was cancelled releases its slot and bytes, which pass on the same way.
"""

from __future__ import annotations

import collections
import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import trio

if TYPE_CHECKING:
    from ..model._gguf import ModelConfig
    from ..model._tokenizer import Tokenizer

T = TypeVar("T")

F32_BYTES = 4
MODEST_REQUEST_TOKENS = 1024  # a prompt plus the chat default of 512 new tokens, with room
# Threads that tokenize prompts and render chat templates: two keep a second request moving
# while one long prompt is tokenized, and leave the other cores to the stages.
TOKENIZER_THREADS = 2
# Requests tokenizing or waiting for a tokenizer thread before 429: each holds its body (at
# most 4 MiB) meanwhile, and at ~0.5 s for the longest prompt a context allows, the last one
# waits ~8 s.
MAX_TOKENIZING = 32


@functools.lru_cache(maxsize=16)
def _longest_token_chars(tokenizer: Tokenizer) -> int:
    return max(tokenizer.longest_token_chars(), 1)


def prompt_char_limit(tokenizer: Tokenizer, context_length: int) -> int:
    """The most characters a prompt that fits ``context_length`` tokens can have.

    Every token of a byte-level BPE vocabulary stands for at most as many characters as its
    vocabulary entry is long (an entry spells one byte per character, and a character is one
    byte or more; a control token is its own text). The tokens of a prompt together spell the
    whole prompt, so a text longer than ``(context_length - 1)`` times the longest entry has at
    least ``context_length`` tokens and could never fit. The bound never refuses a prompt that
    would: it is what lets a handler refuse a 4 MB prompt without tokenizing it.
    """
    return max(context_length - 1, 0) * _longest_token_chars(tokenizer)


def kv_bytes_per_token(config: ModelConfig) -> int:
    """KV cache one token takes over the whole pipeline: K and V, every layer, float32."""
    return config.n_layers * 2 * config.n_kv_heads * config.head_dim * F32_BYTES


def parameter_count(config: ModelConfig) -> int:
    """The model's weights, counted from its shape (llama layout, norms included)."""
    d, q, kv = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    layer = 2 * d + d * q * 2 + d * kv * 2 + 3 * d * config.d_ff
    embeddings = config.vocab_size * d * (1 if config.tied_output else 2)
    return config.n_layers * layer + embeddings + d


def default_kv_budget(config: ModelConfig, max_batch: int) -> int:
    """The ``--kv-budget`` when none is given, in bytes.

    The largest of: the model's float32 weights (one forward's worth of memory), ``max_batch``
    requests of `MODEST_REQUEST_TOKENS` each, and one request that fills the whole context
    (so the default never refuses a request the model would take).
    """
    per_token = kv_bytes_per_token(config)
    return max(
        parameter_count(config) * F32_BYTES,
        max_batch * MODEST_REQUEST_TOKENS * per_token,
        config.context_length * per_token,
    )


class TicketState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RELEASED = "released"


class Ticket:
    """One admitted request's claim on a slot and ``reserve`` bytes; `release` it when done."""

    def __init__(self, admission: Admission, state: TicketState, reserve: int) -> None:
        self._admission = admission
        self.state = state
        self.reserve = reserve
        self._granted = trio.Event()
        if state is TicketState.RUNNING:
            self._granted.set()

    def __repr__(self) -> str:
        return f"<Ticket {self.state.value} reserve={self.reserve}>"

    async def wait(self) -> None:
        """Wait until this ticket may run (returns at once if it already may)."""
        if self.state is TicketState.RELEASED:
            raise RuntimeError("can't wait on a released ticket")
        await self._granted.wait()

    def _grant(self) -> None:
        self.state = TicketState.RUNNING
        self._granted.set()

    def release(self) -> None:
        """Give the slot and the bytes (or the place in line) back; idempotent."""
        state, self.state = self.state, TicketState.RELEASED
        if state is TicketState.RUNNING:
            self._admission._finished(self)
        elif state is TicketState.WAITING:
            self._admission._leave_line(self)


class Admission:
    """At most ``max_batch`` running within ``kv_budget`` bytes, a bounded FIFO line in front.

    Args:
        max_batch: requests that generate at once (at most the lane pool's capacity, so a
            running request always finds a lane).
        max_queue: requests that may wait; beyond that `try_admit` refuses.
        kv_budget: bytes of KV cache the running requests may reserve together (None: no
            limit but ``max_batch``).
        on_start: called with the number running, each time a request starts to run.
        tokenizer_threads: worker threads that tokenize prompts (`tokenize`).
        max_tokenizing: requests that may be tokenizing or waiting for a tokenizer thread.
    """

    def __init__(
        self,
        max_batch: int,
        max_queue: int,
        kv_budget: int | None = None,
        *,
        on_start: Callable[[int], None] | None = None,
        tokenizer_threads: int = TOKENIZER_THREADS,
        max_tokenizing: int = MAX_TOKENIZING,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {max_queue}")
        if kv_budget is not None and kv_budget < 1:
            raise ValueError(f"kv_budget must be at least 1 byte, got {kv_budget}")
        if not 1 <= tokenizer_threads <= max_tokenizing:
            raise ValueError(
                f"tokenizer_threads ({tokenizer_threads}) must be at least 1 and at most "
                f"max_tokenizing ({max_tokenizing})"
            )
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.kv_budget = kv_budget
        self.running = 0
        self.reserved = 0
        self.rejected = 0
        self._on_start = on_start
        self._line: collections.deque[Ticket] = collections.deque()
        self.max_tokenizing = max_tokenizing
        self.tokenizing = 0  # requests in `tokenize`: in a thread or waiting for one
        self._tokenizers = trio.CapacityLimiter(tokenizer_threads)

    def __repr__(self) -> str:
        budget = "unlimited" if self.kv_budget is None else self.kv_budget
        return (
            f"<Admission max_batch={self.max_batch} running={self.running} "
            f"queued={self.queued}/{self.max_queue} rejected={self.rejected} "
            f"kv={self.reserved}/{budget}>"
        )

    async def tokenize(self, work: Callable[[], T]) -> T | None:
        """Run ``work`` (tokenize a prompt) in a tokenizer thread; None when the line is full.

        A refusal counts in ``rejected``, like one of `try_admit`. Cancelling the caller waits
        for a ``work`` already running (it cannot be interrupted) but not for a thread.
        """
        if self.tokenizing >= self.max_tokenizing:
            self.rejected += 1
            return None
        self.tokenizing += 1
        try:
            return await trio.to_thread.run_sync(work, limiter=self._tokenizers)
        finally:
            self.tokenizing -= 1

    @property
    def queued(self) -> int:
        return len(self._line)

    def never_fits(self, reserve: int) -> bool:
        """Whether ``reserve`` bytes exceed the whole budget, so the request could never run."""
        return self.kv_budget is not None and reserve > self.kv_budget

    def try_admit(self, reserve: int = 0) -> Ticket | None:
        """Decide now: a running ticket, a waiting one, or None when the line is full.

        Raises:
            ValueError: ``reserve`` could never fit (ask `never_fits` first).
        """
        if self.never_fits(reserve):
            raise ValueError(f"a reservation of {reserve} bytes exceeds the budget {self}")
        if not self._line and self._fits(reserve):
            ticket = Ticket(self, TicketState.RUNNING, reserve)
            self._start(ticket)
            return ticket
        if len(self._line) < self.max_queue:
            ticket = Ticket(self, TicketState.WAITING, reserve)
            self._line.append(ticket)
            return ticket
        self.rejected += 1
        return None

    def _fits(self, reserve: int) -> bool:
        if self.running >= self.max_batch:
            return False
        return self.kv_budget is None or self.reserved + reserve <= self.kv_budget

    def _start(self, ticket: Ticket) -> None:
        self.running += 1
        self.reserved += ticket.reserve
        if self._on_start is not None:
            self._on_start(self.running)

    def _grant_line(self) -> None:
        """Start waiters from the head while the head fits (head-of-line: no overtaking)."""
        while self._line and self._fits(self._line[0].reserve):
            ticket = self._line.popleft()
            self._start(ticket)
            ticket._grant()

    def _finished(self, ticket: Ticket) -> None:
        self.running -= 1
        self.reserved -= ticket.reserve
        self._grant_line()

    def _leave_line(self, ticket: Ticket) -> None:
        self._line.remove(ticket)
        self._grant_line()  # the one behind may fit where this one did not
