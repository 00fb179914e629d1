"""Prefix blocks: how stage 0 names the KV a stage may already hold for a request's prefix.

A request's tokens are cut into blocks of `PREFIX_BLOCK` tokens. Block ``i`` is named by a
64-bit hash chained over every block up to it, ``h_i = H(h_{i-1} || tokens of block i)``, so
one name stands for the whole prefix that ends with that block (and its positions): two
requests share block ``i``'s name only if they share their first ``i + 1`` blocks. Stage 0
sends the names (``Configure.prefix``, ``Remember.prefix``); the other stages only see names
and hidden states, never tokens, and key their caches by name.

``H`` is keyed BLAKE2b with a secret ``salt`` that stage 0 draws per pipeline: names from one
pipeline never match another's (whose stages may split or encode activations differently), a
peer that sees names cannot build prompts whose names collide, and a block name says nothing
of its tokens. Only whole blocks are named; a partial last block is always recomputed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ._messages import MAX_PREFIX_NAMES, PREFIX_BLOCK

__all__ = ["PREFIX_BLOCK", "prefix_chain"]


def prefix_chain(tokens: Sequence[int], salt: bytes, *, blocks: int | None = None) -> list[int]:
    """The names of the whole blocks of ``tokens`` (at most ``blocks`` of them), in order.

    ``salt`` keys the hash (16 to 64 bytes). Names are ints in ``[0, 2**64)``.
    """
    count = len(tokens) // PREFIX_BLOCK
    if blocks is not None:
        count = min(count, blocks)
    count = min(count, MAX_PREFIX_NAMES)
    ids = np.asarray(tokens[: count * PREFIX_BLOCK], dtype="<i4").tobytes()
    step = PREFIX_BLOCK * 4
    names: list[int] = []
    previous = b"\0" * 8
    for i in range(count):
        digest = hashlib.blake2b(
            previous + ids[i * step : (i + 1) * step], digest_size=8, key=salt
        ).digest()
        names.append(int.from_bytes(digest, "little"))
        previous = digest
    return names
