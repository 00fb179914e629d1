"""What every backend that runs a layer range of a GGUF model keeps the same way."""

from __future__ import annotations

import os
from typing import ClassVar

from .._errors import UnsupportedModelError
from ..model import ModelConfig, ModelFile, open_model

__all__ = ["GgufLayers"]


class GgufLayers:
    """Mixin: the model, the half-open block range ``[lo, hi)`` and what follows from them.

    A backend calls `_open_layers` first in its ``__init__``; it then has ``model``,
    ``config``, ``layers``, ``is_first``, ``is_last``, ``d_model`` and ``vocab_size`` as
    `stagerun.abc.ComputeBackend` asks.
    """

    model: ModelFile
    _lo: int
    _hi: int
    families: ClassVar[frozenset[str] | None] = None
    """The model families (`stagerun.model.Family`) the backend runs; None: every one."""

    def _open_layers(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None,
        threads: int | None,
    ) -> ModelConfig:
        """Open ``model``, check ``layers`` (None: all of them) and ``threads``; the config.

        Raises:
            LayerRangeError: the range is not a non-empty part of the model's blocks.
            UnsupportedModelError: the backend does not run the model's family.
            ValueError: ``threads`` below 1.
        """
        self.model = model if isinstance(model, ModelFile) else open_model(model)
        config = self.model.config
        family = config.family.name
        if self.families is not None and family not in self.families:
            raise UnsupportedModelError(
                f"the {type(self).__name__} runs {', '.join(sorted(self.families))} models; "
                f"{self.model.path.name} is a {family} model: run its stages on a backend "
                "that runs it (numpy does)"
            )
        lo, hi = layers if layers is not None else (0, config.n_layers)
        self.model.check_layers(lo, hi)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}.")
        self._lo, self._hi = lo, hi
        return config

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"first={self.is_first} last={self.is_last} threads={getattr(self, 'threads', None)}>"
        )

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def layers(self) -> tuple[int, int]:
        return (self._lo, self._hi)

    @property
    def is_first(self) -> bool:
        """This stage owns the embeddings and takes token ids."""
        return self._lo == 0

    @property
    def is_last(self) -> bool:
        """This stage owns the output norm and head and returns logits."""
        return self._hi == self.config.n_layers

    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size
