"""A drafter for tests and benchmarks that knows the answer.

It proposes the target's own tokens, taken from a reference run, and gets a deterministic
fraction of them wrong, so a test can set the acceptance rate it wants to exercise: 0.0 is a
perfect drafter, 1.0 one that is always wrong. Whether the guess at a position is wrong depends
only on ``(seed, position)``, so stale windows and retries see the same guesses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..abc import Drafter, DrafterOptions


class OracleDrafter(Drafter):
    """Proposes ``reference[len(context):]`` with a deterministic error rate.

    Args:
        reference: the target's full token sequence (prompt followed by its plain decode).
        error_rate: fraction of positions whose guess is replaced by a wrong token.
        vocab_size: wrong tokens are drawn below this id.
    """

    name = "oracle"
    blocking = False

    @classmethod
    def create(cls, options: DrafterOptions) -> OracleDrafter:
        raise ValueError(
            "the oracle drafter needs the target's reference tokens: construct "
            "OracleDrafter(reference, error_rate=..., vocab_size=...) and pass it as drafter="
        )

    def __init__(
        self, reference: Sequence[int], *, error_rate: float = 0.0, vocab_size: int, seed: int = 0
    ) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be within [0, 1], got {error_rate}")
        self.reference = [int(t) for t in reference]
        self.error_rate = error_rate
        self.vocab_size = vocab_size
        self.seed = seed

    def begin(self, prompt: Sequence[int]) -> None:
        if list(prompt) != self.reference[: len(prompt)]:
            raise ValueError("the oracle's reference does not start with this prompt")

    def commit(self, tokens: Sequence[int]) -> None:
        pass

    def _wrong_at(self, position: int) -> bool:
        if self.error_rate <= 0.0:
            return False
        digest = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.error_rate

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        # Guesses depend on the position alone, also when the context has left the reference
        # (the optimistic drafts of earlier windows were wrong): like a real drafter, it keeps
        # guessing, and the windows it fills go stale.
        start = len(context)
        proposal = []
        for position in range(start, min(start + max_tokens, len(self.reference))):
            token = self.reference[position]
            if self._wrong_at(position):
                token = (token + 1 + position % 7) % self.vocab_size
            proposal.append(token)
        return proposal
