"""A stage's compute, one tick at a time, over the ready work of every session.

Theory of operation: each session's task (a lane worker on a stage server, a request on
stage 0) hands its next forward to `TickBatcher.forward` and waits. A tick is one batched
forward through the backend (`stagerun.abc.ComputeBackend.forward_batch`) in a worker thread;
whatever arrives while a tick runs waits for the next one, which starts the moment this one
ends (continuous batching: no tick ever waits for more work). `stagerun._decide._ticks`
decides which waiting forwards a tick takes.

There is no batcher task: the first waiting task that finds no tick running runs the next
tick for everybody, then wakes the others; one whose forward is done returns, another runs the
tick after. A tick is never abandoned half-way: the thread finishes, and its results are
delivered, even if the task running it is cancelled meanwhile (that task then raises).

A tick of one session's decode step or verify window, when the computes of its size have lately
taken at most ``inline_seconds`` (the latest one too), runs on the Trio thread itself once every
other ready task has run (so a token on its way to a client is written first): the loop is held
that long, and the two hand-offs of a worker thread (about 0.3 ms on a 2-core VM, paid at every
stage for every token of a lone stream) are saved. The decode step of a stage's only session
may hold the loop longer, `LONE_INLINE_SECONDS`, as nobody else waits for it (a verify window
keeps ``inline_seconds``: a ``Cancel`` read meanwhile should stop it, and the replies of its
session's other windows wait). A tick of several sessions or of a prefill chunk always runs
in a worker thread, where the loop goes on reading and sending for the others meanwhile.

A verify window named by a ``Cancel`` before its tick starts is dropped unseen; one cancelled
during its tick stops at the next layer boundary (its ``should_stop``) while the rest of the
batch goes on. When a batched forward fails (a session sent activations of the wrong width,
say), its items are run again one by one, so only the faulty one fails.
"""

from __future__ import annotations

import collections
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import trio

try:
    # What trio.testing.wait_all_tasks_blocked is (the one public way to wait for an idle
    # loop), taken where trio defines it: importing trio.testing imports pytest wherever that is
    # installed, 0.1 s of every stage process's start under a test suite.
    from trio._core import wait_all_tasks_blocked  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a trio that moved it
    from trio.testing import wait_all_tasks_blocked

from .._decide._ticks import DEFAULT_TICK_ROWS, Waiting, choose_tick
from .._errors import ComputeCancelled
from .._util import release_free_memory
from ..abc import ForwardItem, run_batch

__all__ = ["RECENT_SECONDS", "TickBatcher", "TickInfo"]

RECENT_SECONDS = 1.0
# A gathering tick waits at most this many mean ticks' time for the decoding sessions, which
# are those that asked for a decode step or a verify window in the last GATHER_SEEN_SECONDS.
GATHER_TICKS = 3.0
GATHER_SEEN_SECONDS = 0.3
TRIM_SECONDS = 2.0  # a tick's thread gives freed heap memory back at most this often
IDLE_TRIM_SECONDS = 0.5  # after a session ends, this long without a tick: freed memory back
INLINE_SECONDS = 0.01  # the default bound on a tick run on the Trio thread (`TickBatcher`)
INLINE_ROWS = 8  # rows of the one forward of a tick that may run there, at most
# A lone session's decode step may run there while it takes at most this (`TickBatcher._lone`):
# Gemma 3 270M's step on 2 cores (20 ms) over the thread's two hand-offs (0.5 ms a token).
LONE_INLINE_SECONDS = 0.05
INLINE_SETTLE_SECONDS = 0.001  # how long the loop may take to run its other ready tasks first
STALL_SECONDS = 60.0  # a tick showing no progress this long has stalled (`stalled_for`)


@attrs.define
class TickInfo:
    """Filled in by `TickBatcher.forward`: the tick that computed a forward.

    ``started`` is a `time.perf_counter` reading; the time a forward waited for its tick
    is not part of ``seconds``. ``batch`` counts the forwards the tick computed.
    """

    started: float = 0.0
    seconds: float = 0.0
    batch: int = 0


class _Job:
    __slots__ = ("_stop", "item", "outcome", "prefill", "stale", "tick", "window")

    def __init__(
        self,
        item: ForwardItem,
        prefill: bool,
        stale: Callable[[], bool] | None,
        tick: TickInfo | None,
        progress: list[float],
        window: bool = False,
    ) -> None:
        self.prefill, self.stale, self.tick, self.window = prefill, stale, tick, window
        self.outcome: np.ndarray[Any, Any] | BaseException | None = None
        # The item's should_stop reads this list, not the job: a closure over the job would
        # make job -> item -> closure -> job a cycle, and every finished forward's cache and
        # output would wait for the cycle collector (an idle Gemma 3 server held 35 MiB).
        stop = self._stop = [False]
        inner = item.should_stop

        def should_stop() -> bool:  # asked at each layer boundary: the tick goes on
            progress[0] = time.perf_counter()
            return stop[0] or (inner is not None and inner())

        self.item = attrs.evolve(item, should_stop=should_stop)

    @property
    def abandoned(self) -> bool:
        """Its caller was cancelled: the compute stops at the next layer boundary."""
        return self._stop[0]

    @abandoned.setter
    def abandoned(self, value: bool) -> None:
        self._stop[0] = value


class TickBatcher:
    """Runs the forwards of every session on one backend, batched tick by tick.

    Args:
        backend: the stage's compute backend.
        max_rows: rows one tick computes at most (a larger forward runs alone).
        max_items: sessions one tick takes at most (1 turns batching off: one forward a tick).
        gather: the number of groups the decoding sessions should travel in, or None.
            With it, a tick that would start with fewer decode steps than a group's share
            of the decoding sessions waits, a few ticks' time at most, for the rest (see
            `_gather`). Stage 0 gathers: the requests that share its ticks then travel down
            the pipeline together, so every stage computes them in one tick; without it,
            closed-loop requests drift apart and most ticks compute one or two of them.
        inline_seconds: a tick of one forward (a decode step or verify window of at most
            `INLINE_ROWS` rows, no prefill) runs on the Trio thread when the computes of that
            many rows have taken at most this, in a running estimate and the latest one; the
            first of each size runs in a worker thread to measure (a lone session's decode
            step, see `_lone`, up to `LONE_INLINE_SECONDS` if that is more). 0 turns it off.
            The loop serves nothing else meanwhile, so this is about how long the batcher
            may hold it (a compute that hangs there holds it for good: a stage then fails its
            liveness probes by timing out).
    """

    def __init__(
        self,
        backend: Any,
        *,
        max_rows: int = DEFAULT_TICK_ROWS,
        max_items: int | None = None,
        gather: int | None = None,
        inline_seconds: float = INLINE_SECONDS,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        if max_items is not None and max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        if gather is not None and gather < 1:
            raise ValueError(f"gather must be at least 1 group, got {gather}")
        if not inline_seconds >= 0:
            raise ValueError(f"inline_seconds must be 0 or more, got {inline_seconds}")
        self.backend = backend
        self.max_rows = max_rows
        self.max_items = max_items
        self.gather = gather
        self.inline_seconds = inline_seconds
        self.inline_ticks = 0  # ticks run on the Trio thread
        # rows -> (running estimate, latest) of a one-forward tick's compute, in seconds
        self._small_ticks: dict[int, tuple[float, float]] = {}
        self._computed = 0.0  # the latest tick's compute alone (no hand-off, no trim)
        self.gathered_seconds = 0.0  # time ticks waited for more work
        self._seen: dict[int, float] = {}  # session (cache id) -> when it last asked
        self._sessions: set[int] = set()  # sessions (cache ids) computed here, not yet ended
        self._arrived = trio.Event()
        self._trimmed = time.perf_counter()
        self._trimming = False  # a trim waits for a quiet spell (`forget`)
        self._waiting: list[_Job] = []
        self._running: trio.Event | None = None
        self._computing: list[_Job] = []  # the jobs of the tick whose thread runs now
        self._progress = [0.0]  # when that tick last showed progress (began, reached a layer)
        self.ticks = 0
        self.items = 0  # forwards computed (a stale one dropped before its tick is not)
        self.rows = 0
        self.busy_seconds = 0.0  # time in ticks (hand-offs to and from their threads included)
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # items per tick
        self.started = time.perf_counter()
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (end, s)

    def __repr__(self) -> str:
        return (
            f"<TickBatcher ticks={self.ticks} items={self.items} rows={self.rows} "
            f"waiting={len(self._waiting)} busy={self.busy_fraction():.2f}>"
        )

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def busy_fraction(self) -> float:
        """The share of the time since start that ticks were computing."""
        elapsed = time.perf_counter() - self.started
        return min(1.0, self.busy_seconds / elapsed) if elapsed > 0 else 0.0

    def recent_busy(self, seconds: float = RECENT_SECONDS) -> float:
        """The share of the last ``seconds`` that ticks were computing (the load right now)."""
        now = time.perf_counter()
        while self._recent and self._recent[0][0] < now - seconds:
            self._recent.popleft()
        busy = sum(min(took, end - (now - seconds)) for end, took in self._recent)
        return min(1.0, busy / seconds)

    def stalled_for(self, now: float | None = None) -> float:
        """How long the tick computing in a worker thread now has shown no progress: since
        it began or its backend last asked, at a layer boundary, whether to stop (0 when no
        tick computes there). Past `STALL_SECONDS` the stage's compute is taken to hang: a
        stage server then refuses handshakes, so its supervisor's liveness probe fails."""
        if not self._computing:
            return 0.0
        return max(0.0, (time.perf_counter() if now is None else now) - self._progress[0])

    def stall(self, timeout: float) -> str | None:
        """Why the compute counts as hung (`stalled_for` past ``timeout``), or None."""
        stalled = self.stalled_for()
        if stalled > timeout:
            return f"compute has shown no progress for {stalled:.0f} s"
        return None

    async def forward(
        self,
        item: ForwardItem,
        *,
        prefill: bool = False,
        stale: Callable[[], bool] | None = None,
        tick: TickInfo | None = None,
        window: bool = False,
    ) -> np.ndarray[Any, Any]:
        """Compute ``item`` in the next tick that takes it; its output.

        ``stale()`` True when the tick starts drops the item unseen (`ComputeCancelled`).
        ``tick``, if given, is filled in with the tick that computed the item. ``window``:
        the item is a verify window (whose tick holds the loop no longer than
        ``inline_seconds``, even with one row: its session's replies and a ``Cancel`` wait).

        Raises:
            ComputeCancelled: the item was dropped before its tick or stopped in it.
        """
        job = _Job(item, prefill, stale, tick, self._progress, window)
        self._waiting.append(job)
        self._sessions.add(id(item.cache))
        if not prefill:  # a decoding session: the ones ticks gather
            self._seen[id(item.cache)] = time.perf_counter()
        self._arrived.set()
        try:
            while job.outcome is None:
                if self._running is None:
                    await self._tick(job)
                else:
                    await self._running.wait()
        finally:
            if job.outcome is None:  # cancelled
                if job in self._waiting:
                    self._waiting.remove(job)  # while it waited
                else:
                    self._abandon(job)  # while a tick computes it: it stops there
        if isinstance(job.outcome, BaseException):
            # Its traceback's frames hold the tick's items (activations, caches) in a cycle
            # with the exception: clear their locals (the lines stay for the log), or a peer
            # sending refused activations fast grows the stage until the cycle collector runs.
            traceback.clear_frames(job.outcome.__traceback__)
            raise job.outcome
        return job.outcome

    def forget(self, cache: object) -> None:
        """The session of ``cache`` has ended: ticks no longer gather for its decode steps,
        nor count it among the sessions served (`_lone`).

        Without this, a request that starts just after another ended (a closed-loop client)
        would wait at each of its first ticks, `GATHER_SEEN_SECONDS` long, for a session that
        will never ask again.
        """
        self._seen.pop(id(cache), None)
        self._sessions.discard(id(cache))
        if not self._trimming:
            # A session ended: once no tick has run for IDLE_TRIM_SECONDS, the heap the
            # sessions left is given back; the ticks' own trims need a next tick, which an
            # idle server never runs (Gemma 3's server process held 11-24 MiB more).
            try:
                trio.lowlevel.spawn_system_task(self._trim_when_idle)
            except RuntimeError:  # not in a Trio run: nothing to wait in
                return
            self._trimming = True

    async def _trim_when_idle(self) -> None:
        try:
            ticks = -1
            while ticks != self.ticks or self._waiting or self._running is not None:
                ticks = self.ticks
                await trio.sleep(IDLE_TRIM_SECONDS)
            await trio.to_thread.run_sync(self._release)
        finally:
            self._trimming = False
            self._trimmed = time.perf_counter()

    def _release(self) -> None:
        """What a stage gives back when idle and every `TRIM_SECONDS` of ticks: the memory its
        backend keeps for ended sessions (an optional ``release_memory()``, as the ggml
        backend's KV slots), then the heap's."""
        release = getattr(self.backend, "release_memory", None)
        if callable(release):
            release()
        release_free_memory()

    async def _tick(self, own: _Job) -> None:
        """Run one tick in a worker thread; ``own`` is the job of the task that runs it."""
        done = self._running = trio.Event()
        try:
            await trio.lowlevel.checkpoint()  # work that is ready now joins this tick
            if self.gather is not None:
                await self._gather(self.gather)
            settled = self._quick(self._waiting) and await self._settle()
            jobs = self._take()
            if jobs:
                await self._run(jobs, own, inline=settled and self._quick(jobs))
        finally:
            self._running = None
            done.set()

    def _quick(self, jobs: list[_Job]) -> bool:
        """Whether ``jobs`` would be a tick to run inline: one small forward, no prefill,
        whose size's computes have lately taken at most ``inline_seconds``, the latest too
        (an estimate per row count: a step of 1 row and a window of 8 differ); or at most
        `LONE_INLINE_SECONDS` for the decode step of the only session here (`_lone`)."""
        if len(jobs) != 1 or not _small(jobs[0]) or not self.inline_seconds:
            return False
        seen = self._small_ticks.get(jobs[0].item.rows)
        if seen is None:
            return False
        bound = LONE_INLINE_SECONDS if self._lone(jobs[0]) else 0.0
        return max(seen) <= max(bound, self.inline_seconds)

    def _lone(self, job: _Job) -> bool:
        """Whether ``job`` is a decode step (one row, not a verify window) of the only session
        this stage serves (every session that has asked for a forward and not ended counts,
        a prefilling one too): the loop has nobody else to serve while it computes, so it may
        hold it for longer."""
        return not job.window and job.item.rows == 1 and self._sessions == {id(job.item.cache)}

    async def _settle(self) -> bool:
        """Let every other ready task run first: a token on its way to a client (stage 0's
        answer goes through several tasks) is written before the loop is held, not after.
        False if the loop is still busy after `INLINE_SETTLE_SECONDS` (then no inline tick)."""
        with trio.move_on_after(INLINE_SETTLE_SECONDS):
            await wait_all_tasks_blocked()
            return True
        return False

    async def _run(self, jobs: list[_Job], own: _Job, *, inline: bool) -> None:
        """Compute a tick's ``jobs``, on this thread if ``inline``, else in a worker thread."""
        start = self._progress[0] = time.perf_counter()
        if inline:
            self._compute(jobs, trim=False)  # no checkpoint: nothing else runs meanwhile
            self.inline_ticks += 1
        else:
            await self._in_thread(jobs, own)
        self._count(jobs, start, time.perf_counter())
        if len(jobs) == 1 and _small(jobs[0]):  # what `_quick` reads: the compute alone
            rows, took = jobs[0].item.rows, self._computed
            estimate = self._small_ticks.get(rows, (took, took))[0]
            self._small_ticks[rows] = (estimate + (took - estimate) / 4, took)

    async def _in_thread(self, jobs: list[_Job], own: _Job) -> None:
        """Compute ``jobs`` in a worker thread, which a cancelled caller does not wait out.

        Cancelled meanwhile, the caller's own job is abandoned, so its compute stops at the
        next layer boundary (as a stale verify window's does), and the caller waits only for
        that and for the tick's other jobs, then is cancelled: a long prefill chunk no longer
        holds a cancellation for its whole compute.
        """
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def work() -> None:
            try:
                self._compute(jobs)
            finally:
                token.run_sync_soon(finished.set)

        self._computing = jobs
        try:
            await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except trio.Cancelled:
            self._abandon(own)
            with trio.CancelScope(shield=True):  # the tick's caches are the thread's till then
                await finished.wait()
            raise
        finally:
            self._computing = []

    def _abandon(self, job: _Job) -> None:
        """``job``'s caller is gone: it stops at its next layer boundary, or at once when no
        job of the running tick is wanted any more and the backend can interrupt a graph."""
        job.abandoned = True
        if job in self._computing and all(j.abandoned for j in self._computing):
            interrupt = getattr(self.backend, "interrupt", None)
            if callable(interrupt):
                interrupt()

    async def _gather(self, groups: int) -> None:
        """Wait, `GATHER_TICKS` mean ticks at most, until a group's share of decode steps waits.

        The decoding sessions are those that asked for a decode step or a verify window in
        the last `GATHER_SEEN_SECONDS`; a tick that would take fewer than ``1/groups`` of
        them waits for the rest of its share. One session alone never waits, nor does a
        tick once its share is there; prefill chunks neither count nor wait (a tick of
        prefill chunks alone starts at once).
        """
        now = time.perf_counter()
        for key in [k for k, seen in self._seen.items() if seen < now - GATHER_SEEN_SECONDS]:
            del self._seen[key]
        share = -(-len(self._seen) // groups)
        if not 0 < self._decoding() < share or not self.ticks:
            return  # no decode step to gather, or its share is there
        with trio.move_on_after(GATHER_TICKS * self.busy_seconds / self.ticks):
            while self._decoding() < share:
                self._arrived = trio.Event()
                await self._arrived.wait()
        self.gathered_seconds += time.perf_counter() - now

    def _decoding(self) -> int:
        return sum(not job.prefill for job in self._waiting)

    def _take(self) -> list[_Job]:
        """Remove this tick's jobs from the line; stale ones are answered at once."""
        for job in [j for j in self._waiting if j.stale is not None and j.stale()]:
            job.outcome = ComputeCancelled("dropped before its compute started")
            self._waiting.remove(job)
        line = [Waiting(j.item.rows, j.prefill, id(j.item.cache)) for j in self._waiting]
        chosen = choose_tick(line, self.max_rows)[: self.max_items]
        jobs = [self._waiting[i] for i in chosen]
        taken = set(chosen)
        self._waiting = [j for i, j in enumerate(self._waiting) if i not in taken]
        return jobs

    def _compute(self, jobs: list[_Job], *, trim: bool = True) -> None:
        """One tick, in the worker thread (or inline): every job gets its outcome; ``trim``:
        give freed heap back if the last trim is `TRIM_SECONDS` old (never on the loop)."""
        items = [job.item for job in jobs]
        started = time.perf_counter()
        try:
            with np.errstate(all="ignore"):  # what is not finite is refused by the caller
                try:
                    outcomes: list[Any] = run_batch(self.backend, items)
                except Exception:
                    if len(items) == 1:
                        raise
                    outcomes = [_alone(self.backend, item) for item in items]
        except Exception as exc:
            outcomes = [exc]
        self._computed = time.perf_counter() - started
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.outcome = outcome
        if trim and time.perf_counter() - self._trimmed > TRIM_SECONDS:
            self._trimmed = time.perf_counter()
            self._release()  # ended sessions' caches and big temporaries

    def _count(self, jobs: list[_Job], start: float, end: float) -> None:
        """Add a finished tick to the counters (on the Trio thread, like every reader)."""
        for job in jobs:
            if job.tick is not None:
                job.tick.started, job.tick.seconds, job.tick.batch = start, end - start, len(jobs)
        self.busy_seconds += end - start
        self._recent.append((end, end - start))
        self.ticks += 1
        self.items += len(jobs)
        self.rows += sum(job.item.rows for job in jobs)
        self.batch_sizes[len(jobs)] += 1


def _small(job: _Job) -> bool:
    return not job.prefill and job.item.rows <= INLINE_ROWS


def _alone(backend: Any, item: ForwardItem) -> np.ndarray[Any, Any] | BaseException:
    """One item of a failed batch, computed on its own: its output, or its own error."""
    try:
        (outcome,) = run_batch(backend, [item])
    except Exception as exc:
        return exc
    return outcome
