"""The conformance suite of a model family (`stagerun.model.Family`): its tiny model runs.

A family is data, so what can go wrong is that its traits do not fit together, or that the
backends do not run a combination of them as one function: the suite writes a tiny random
GGUF of the family (`stagerun.testing.write_tiny_model`), opens it through the registry,
and runs it through the numpy backend's conformance suite, split in three, and chunked.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._common import _checking

__all__ = ["check_family"]

_IDS = [5, 17, 99, 130, 44, 250, 3, 9, 77, 12, 200, 31] * 6  # past a tiny window (40)


def check_family(
    family: Any,
    *,
    directory: str | os.PathLike[str] | None = None,
    backend: Any = None,
    **tiny: Any,
) -> None:
    """Check that the model family ``family`` loads and runs as one function of its tokens.

    Checks that: a tiny GGUF of the family (written with ``write_tiny_model(family=family,
    **tiny)``) opens as that family, by its architecture name, through the built-ins and the
    ``stagerun.architectures`` plugins; it holds the tensors the family names
    (`Family.layer_tensors`) and they load for every layer range; the backend passes
    `check_backend` on it; its logits do not depend on how the prompt is chunked; the model
    split in three stages gives one stage's logits; and the output depends on the input (two
    prompts, two different continuations), so the other checks could fail.

    Args:
        family: the `stagerun.model.Family` to check; a plugin's must be installed, so that
            `stagerun.model.open_model` finds it by name.
        directory: where to write the tiny file (default: a temporary directory).
        backend: the backend class to run it with (default `stagerun.backends.NumpyBackend`).
        tiny: more `write_tiny_model` arguments (``sliding_window``, softcaps...).

    Raises:
        AssertionError: a check failed; the message names it.
    """
    from ...backends import NumpyBackend
    from ...model import open_model
    from .._tiny_model import write_tiny_model
    from ._backend import check_backend

    factory = backend or NumpyBackend
    with tempfile.TemporaryDirectory(dir=directory) as folder:
        path = pathlib.Path(folder) / f"tiny-{family.name}.gguf"
        with check("check_family", "writing its tiny model"):
            write_tiny_model(path, family=family, **tiny)
        with check("check_family", "opening the file finds the family by its name"):
            model = open_model(path)
            assert model.config.family == family, (
                f"the file opened as {model.config.family!r}, not {family!r}: a built-in "
                "or another plugin claims its architecture name"
            )
        c = model.config
        with check("check_family", "the file holds the family's tensors"):
            names = set(model.tensor_names())
            wanted = {f"blk.{i}.{t}" for i in range(c.n_layers) for t in family.layer_tensors()}
            assert wanted <= names, f"missing {sorted(wanted - names)[:3]}"
            for lo in range(c.n_layers):
                model.load_weights(lo, lo + 1, embeddings=lo == 0, head=lo == c.n_layers - 1)
        with check("check_family", "the backend's conformance suite"):
            check_backend(factory, model)
        whole = factory(model, (0, c.n_layers))
        want = whole.forward(whole.new_cache(), 0, tokens=_IDS, logits="all")
        with check("check_family", "the output depends on the input"):
            other = whole.forward(whole.new_cache(), 0, tokens=_IDS[::-1], logits="all")
            assert want[-1].argmax() != other[-1].argmax() or np.abs(want - other).max() > 1e-2
        with check("check_family", "a prompt in chunks computes what it does whole"):
            cache = whole.new_cache()
            parts = [
                whole.forward(cache, a, tokens=_IDS[a:b], logits="all")
                for a, b in ((0, 7), (7, 41), (41, len(_IDS)))
            ]
            _close(np.concatenate(parts), want, "chunked")
        with check("check_family", "three stages compute what one does"):
            cut = [0, 1, max(2, c.n_layers - 1), c.n_layers]
            hidden: Any = None
            for lo, hi in itertools.pairwise(cut):
                stage = factory(model, (lo, hi))
                hidden = stage.forward(
                    stage.new_cache(),
                    0,
                    tokens=_IDS if lo == 0 else None,
                    hidden=hidden,
                    logits="all",
                )
            _close(hidden, want, "split in three")


@contextlib.contextmanager
def check(suite: str, name: str) -> Iterator[None]:
    """A named check: its failure, an assertion or not, says which check it was."""
    try:
        with _checking(suite, name):
            yield
    except AssertionError as exc:
        prefix = f"{suite}: {name}: "
        if str(exc).startswith(prefix):
            raise
        raise AssertionError(prefix + str(exc)) from exc


def _close(got: Any, want: Any, what: str) -> None:
    error = float(np.abs(got - want).max() / max(1e-30, float(np.abs(want).max())))
    assert error < 1e-4, f"{what}: logits differ by {error:.3g} (relative)"
