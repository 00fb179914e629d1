"""Admission by memory: at most ``max_batch`` requests generate at once, within a KV budget.

Theory of operation: before a request can be priced it must be tokenized, and tokenizing (and
rendering a chat template) is CPU work that must not run on the event loop: `Admission.tokenize`
runs it in one of a few worker threads (``tokenizer_threads``), and a bounded number of
requests (``max_tokenizing``) may be in that line at once; beyond that it refuses too. Text
reaches it only once `prompt_char_limit` has bounded it by the model's context.

Tokenizing counts against the request's deadline: the job carries a `CpuBudget`, the caller
waits no longer than the deadline (504), and the job checks the budget between pieces of work,
so one its caller gave up stops within a piece. `encode_within` tokenizes a long text in
pieces of `PIECE_CHARS` and stops once the pieces hold more tokens than the context: a prompt
far over the context costs a few pieces, not the whole text. Jobs are short (at most
`SHORT_JOB_CHARS`) or long; long ones never take the last tokenizer thread nor the last places
in line, so a flood of long prompts cannot hold up short ones.

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
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

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
# most 4 MiB) meanwhile; a quarter of the places are for short jobs only.
MAX_TOKENIZING = 32
# Characters tokenized at a time when a long text is counted (10-20 ms of work): the most a job
# runs past its budget, and the granularity at which a text over the context is found out.
PIECE_CHARS = 32_768
# A text of at most this many characters per token of room is tokenized whole at once: honest
# text has 3-5 (code and other languages fewer), so only texts likely over the context, or
# very dense, are counted in pieces first.
WHOLE_CHARS_PER_TOKEN = 6
SHORT_JOB_CHARS = PIECE_CHARS  # jobs this small take any thread and any place in line


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


class CpuBudgetExceeded(Exception):
    """The request's time ran out while its prompt was tokenized or rendered (a 504)."""


class CpuBudget:
    """How long one request's tokenizing and rendering may run: until the request's deadline,
    or until its caller gave the job up (`cancel`). The worker thread calls `check` between
    pieces of work, and gives a chat template the time `left`.

    Args:
        deadline: ``trio.current_time()`` when the request runs out of time (inf: never).
    """

    def __init__(self, deadline: float = math.inf) -> None:
        self.deadline = deadline
        left = deadline - trio.current_time() if math.isfinite(deadline) else math.inf
        self._until = time.monotonic() + left  # the worker thread has no Trio clock
        self._cancelled = False

    def __repr__(self) -> str:
        return f"<CpuBudget {self.left():.3f}s left cancelled={self._cancelled}>"

    def left(self) -> float:
        """Seconds left (negative: past the deadline)."""
        return self._until - time.monotonic()

    def cancel(self) -> None:
        """Stop the job at its next `check` (its caller left; called from the Trio thread)."""
        self._cancelled = True

    def check(self) -> None:
        """Raise `CpuBudgetExceeded` if the job is to stop."""
        if self._cancelled or self.left() <= 0:
            raise CpuBudgetExceeded("the request ran out of time while its prompt was tokenized")


def _cut(text: str, start: int) -> int:
    """Where the piece of ``text`` from ``start`` ends: at most `PIECE_CHARS` on, before a
    space or line break in its second half if there is one (most tokenizers split words there,
    so the pieces tokenize as the whole text does)."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    low = start + PIECE_CHARS // 2
    split = max(text.rfind(" ", low, end), text.rfind("\n", low, end))
    return split if split > start else end


def encode_within(
    tokenizer: Tokenizer,
    text: str,
    most: int,
    budget: CpuBudget,
    *,
    special: bool = True,
    add_bos: bool | None = None,
) -> list[int] | int:
    """``text``'s token ids (`Tokenizer.encode`), or, for a text found to have more than
    ``most`` tokens before it was tokenized whole, how many it has at least.

    A text of at most `WHOLE_CHARS_PER_TOKEN` characters per token of ``most`` is tokenized
    whole. A longer one is counted in pieces first (`_cut`), stopping as soon as they hold more
    than ``most`` tokens; only a text that fits is then tokenized whole, for its exact ids. A
    cut can make the pieces spell out a few more tokens than the whole text has: each counts
    for at most the longest vocabulary entry plus one (a SentencePiece prefix) fewer, so the
    number returned is a lower bound. ``budget`` is checked before each piece.

    Raises:
        CpuBudgetExceeded: the budget ran out.
    """
    if len(text) > max(PIECE_CHARS, WHOLE_CHARS_PER_TOKEN * most):
        slack = _longest_token_chars(tokenizer) + 1
        counted = start = pieces = 0
        while start < len(text):
            end = _cut(text, start)
            budget.check()
            counted += len(tokenizer.encode(text[start:end], special=special, add_bos=False))
            start, pieces = end, pieces + 1
            if counted - pieces * slack > most:
                return counted - pieces * slack
    budget.check()
    return tokenizer.encode(text, special=special, add_bos=add_bos)


class _BothLimiters:
    """A limiter for `trio.to_thread.run_sync` that holds a place in ``outer`` and then one in
    ``inner`` for as long as the thread runs (trio's documented limiter protocol)."""

    def __init__(self, outer: trio.CapacityLimiter, inner: trio.CapacityLimiter) -> None:
        self.outer = outer
        self.inner = inner

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self.outer.acquire_on_behalf_of(borrower)
        try:
            await self.inner.acquire_on_behalf_of(borrower)
        except BaseException:
            self.outer.release_on_behalf_of(borrower)
            raise

    def release_on_behalf_of(self, borrower: object) -> None:
        self.inner.release_on_behalf_of(borrower)
        self.outer.release_on_behalf_of(borrower)


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
        self.long_tokenizing = 0  # of those, long jobs
        self.max_long_tokenizing = max_tokenizing - max_tokenizing // 4
        self._tokenizers = trio.CapacityLimiter(tokenizer_threads)
        self._long_threads = _BothLimiters(
            trio.CapacityLimiter(max(1, tokenizer_threads - 1)), self._tokenizers
        )

    def __repr__(self) -> str:
        budget = "unlimited" if self.kv_budget is None else self.kv_budget
        return (
            f"<Admission max_batch={self.max_batch} running={self.running} "
            f"queued={self.queued}/{self.max_queue} rejected={self.rejected} "
            f"kv={self.reserved}/{budget}>"
        )

    async def tokenize(
        self, work: Callable[[], T], *, budget: CpuBudget | None = None, size: int = 0
    ) -> T | None:
        """Run ``work`` (tokenize a prompt) in a tokenizer thread; None when the line is full.

        A job of ``size`` characters over `SHORT_JOB_CHARS` is long: long jobs may take all
        but the last thread and a quarter of the places in line, so short ones always find a
        place and, soon, a thread. A refusal counts in ``rejected``, like one of `try_admit`.

        Without a ``budget``, cancelling the caller waits for a ``work`` already running. With
        one, the caller waits at most until the budget's deadline, and leaves a thread still
        running behind when it is cancelled: the budget is cancelled, the job stops at its
        next `CpuBudget.check`, and the thread keeps its place until it returns, so the threads
        stay bounded even then.

        Raises:
            CpuBudgetExceeded: the budget's deadline passed first.
        """
        long = size > SHORT_JOB_CHARS
        full = self.tokenizing >= self.max_tokenizing
        if full or (long and self.long_tokenizing >= self.max_long_tokenizing):
            self.rejected += 1
            return None
        self.tokenizing += 1
        self.long_tokenizing += long
        limiter = cast(trio.CapacityLimiter, self._long_threads) if long else self._tokenizers
        try:
            if budget is None:
                return await trio.to_thread.run_sync(work, limiter=limiter)
            with trio.move_on_at(budget.deadline):
                return await trio.to_thread.run_sync(work, limiter=limiter, abandon_on_cancel=True)
            raise CpuBudgetExceeded("the request ran out of time waiting to be tokenized")
        finally:
            self.tokenizing -= 1
            self.long_tokenizing -= long
            if budget is not None:
                budget.cancel()  # a thread left behind stops at its next check

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
