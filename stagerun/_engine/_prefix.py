"""A stage's prefix cache: KV blocks of earlier requests, kept for later ones that share them.

Theory of operation. Stage 0 names a request's whole 4-token blocks by a hash chain
(`stagerun._proto._prefix`): a name stands for a block *and* everything before it. A
`PrefixCache` maps names to copies of this stage's keys and values for those positions
(`ComputeBackend.export_kv`), least recently used first:

* **Restore** (`lookup`, at ``Configure``): the longest run of the request's names held here,
  from its first block; the blocks are copied into the request's new cache
  (`ComputeBackend.import_kv`). Each stage says how far it got, and stage 0 prefills from the
  least of them: a stage that was restarted, or evicted a block, holds less, and the request
  recomputes from there. Nothing is ever guessed.
* **Remember** (`missing` then `insert`, at ``Remember``): the blocks of a request's cache
  that are not held yet are copied in.
* **Eviction**: within ``max_bytes``, and within the stage's `SessionBudget` of KV positions,
  which cached blocks share with running requests: a request that needs room takes it from
  the cache (`reclaim`), and the cache never takes room a request holds. A restore touches
  its blocks last first, so a prefix's first blocks, which every longer prefix needs, are
  the last to go.

The copies cost memory (a block is copied into each request that restores it) and copy time,
and save the compute and the hops of a prefill. The object is plain data, used from the Trio
thread; the copies themselves may run in a worker thread (the blocks are immutable).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from .. import _proto
from .._engine._config import DEFAULT_PREFIX_CACHE_MB as DEFAULT_PREFIX_CACHE_MB
from ._budget import SessionBudget

__all__ = ["DEFAULT_PREFIX_CACHE_MB", "PrefixCache", "keep_blocks", "restore_blocks"]


@attrs.define
class _Block:
    kv: Any  # the backend's export: has ``nbytes``
    nbytes: int
    tokens: tuple[int, ...] | None = None  # the block's tokens, where the stage knew them


class PrefixCache:
    """Blocks of KV by prefix name, least recently used first, within ``max_bytes``.

    Args:
        max_bytes: what the cached blocks may hold together (0 keeps nothing).
        budget: the stage's budget of KV positions, shared with running requests (None: only
            ``max_bytes`` bounds the cache).
    """

    def __init__(self, max_bytes: int, *, budget: SessionBudget | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._budget = budget
        if budget is not None:
            budget.reclaim = self.reclaim
        self.bytes = 0
        self.hits = 0  # lookups that restored at least one block
        self.misses = 0
        self.hit_tokens = 0  # positions restored
        self.lookup_tokens = 0  # positions asked for
        self.stored_blocks = 0
        self.evicted_blocks = 0

    def __repr__(self) -> str:
        return (
            f"<PrefixCache blocks={len(self._blocks)} bytes={self.bytes}/{self.max_bytes} "
            f"hits={self.hits} misses={self.misses}>"
        )

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: int) -> bool:
        return name in self._blocks

    def lookup(self, names: Sequence[int]) -> list[Any]:
        """The held blocks of the longest run of ``names`` from the first; counted."""
        found: list[Any] = []
        for name in names:
            block = self._blocks.get(name)
            if block is None:
                break
            found.append(block.kv)
        for name in reversed(names[: len(found)]):  # the first block ends up most recent
            self._blocks.move_to_end(name)
        self.lookup_tokens += len(names) * _proto.PREFIX_BLOCK
        self.hit_tokens += len(found) * _proto.PREFIX_BLOCK
        if found:
            self.hits += 1
        elif names:
            self.misses += 1
        return found

    def missing(self, names: Sequence[int], length: int) -> list[int]:
        """Indexes of the blocks of ``names`` within ``length`` positions that are not held.

        The held ones are touched (last first), as by a restore.
        """
        whole = min(len(names), length // _proto.PREFIX_BLOCK)
        held = [i for i in range(whole) if names[i] in self._blocks]
        for i in reversed(held):
            self._blocks.move_to_end(names[i])
        return [i for i in range(whole) if names[i] not in self._blocks]

    def insert(self, name: int, kv: Any, tokens: Sequence[int] | None = None) -> bool:
        """Keep ``kv`` as block ``name``, evicting the least recently used to make room.

        ``tokens`` are the block's tokens, kept for a last stage that samples after them.
        False when it does not fit (larger than the cache, or the stage's running requests
        hold the KV positions it would need).
        """
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return True
        nbytes = int(kv.nbytes)
        if nbytes > self.max_bytes:
            return False
        while self.bytes + nbytes > self.max_bytes:
            self._evict_one()
        if self._budget is not None:
            while not self._budget.hold_cached(_proto.PREFIX_BLOCK):
                if not self._blocks:
                    return False  # the running requests hold every position
                self._evict_one()
        self._blocks[name] = _Block(kv, nbytes, None if tokens is None else tuple(tokens))
        self.bytes += nbytes
        self.stored_blocks += 1
        return True

    def run_with_tokens(self, names: Sequence[int]) -> int:
        """How many of ``names``, from the first, are held with their tokens (not counted)."""
        for i, name in enumerate(names):
            block = self._blocks.get(name)
            if block is None or block.tokens is None:
                return i
        return len(names)

    def tokens_of(self, names: Sequence[int]) -> list[int] | None:
        """The tokens of the held blocks ``names``, one after another; None if one lacks them."""
        tokens: list[int] = []
        for name in names:
            block = self._blocks.get(name)
            if block is None or block.tokens is None:
                return None
            tokens.extend(block.tokens)
        return tokens

    def reclaim(self, positions: int) -> int:
        """Evict blocks for at least ``positions`` KV positions; the positions freed."""
        freed = 0
        while freed < positions and self._blocks:
            self._evict_one()
            freed += _proto.PREFIX_BLOCK
        return freed

    def clear(self) -> None:
        """Forget every block."""
        while self._blocks:
            self._evict_one()

    def _evict_one(self) -> None:
        _, block = self._blocks.popitem(last=False)
        self.bytes -= block.nbytes
        self.evicted_blocks += 1
        if self._budget is not None:
            self._budget.release_cached(_proto.PREFIX_BLOCK)

    def stats(self) -> _proto.PrefixStats:
        """The counts a stage's ``Status`` reports."""
        return _proto.PrefixStats(
            enabled=True,
            blocks=len(self._blocks),
            bytes=self.bytes,
            max_bytes=self.max_bytes,
            hits=self.hits,
            misses=self.misses,
            hit_tokens=self.hit_tokens,
            lookup_tokens=self.lookup_tokens,
            stored_blocks=self.stored_blocks,
            evicted_blocks=self.evicted_blocks,
        )


async def restore_blocks(
    cache: PrefixCache,
    backend: Any,
    kv: Any,
    names: Sequence[int],
    *,
    room: Callable[[int], bool] = lambda positions: True,
) -> int:
    """Copy the longest held run of ``names`` into the empty cache ``kv``; the blocks copied.

    ``room(positions)`` may refuse the positions (then nothing is copied, and the request
    recomputes them). The copy runs in a worker thread (the blocks are immutable, and ``kv``
    is the caller's).
    """
    blocks = cache.lookup(names)
    if not blocks or not room(len(blocks) * _proto.PREFIX_BLOCK):
        return 0
    await trio.to_thread.run_sync(backend.import_kv, kv, blocks)
    return len(blocks)


async def keep_blocks(
    cache: PrefixCache,
    backend: Any,
    kv: Any,
    names: Sequence[int],
    tokens: Sequence[int] | None = None,
) -> None:
    """Copy the blocks of ``names`` that ``kv`` holds and ``cache`` does not, into ``cache``.

    ``tokens``, where given, are the positions' tokens: each block keeps its own. The copies
    are taken in a worker thread; the caller must not change ``kv`` meanwhile.
    """
    step = _proto.PREFIX_BLOCK
    wanted = cache.missing(names, kv.length)
    if not wanted:
        return

    def copy() -> list[Any]:
        return [backend.export_kv(kv, i * step, (i + 1) * step) for i in wanted]

    for i, block in zip(wanted, await trio.to_thread.run_sync(copy), strict=True):
        own = None
        if tokens is not None and len(tokens) >= (i + 1) * step:
            own = tokens[i * step : (i + 1) * step]
        cache.insert(names[i], block, own)
