"""GGUF layer slices: a model file holding only the blocks one stage runs.

llama.cpp loads whole models, so a stage that runs blocks ``lo..hi-1`` gets its own GGUF: every
metadata key of the source, ``llama.block_count`` set to ``hi - lo``, blocks ``lo..hi-1``
renumbered from 0, and the token embeddings, output norm and output head (llama.cpp needs them
to build its graph even where the stage does not use them). Tensors are copied as they are,
quantized, never converted. Slices are cached on disk, keyed by the source file's SHA-256 and the
range, so each is written once.

A model with local (sliding-window) and global layers needs one more key: llama.cpp derives
which layers are local from their index (Gemma 3: all but every sixth), and a slice renumbers
them, so the slice carries ``{arch}.attention.sliding_window_pattern`` as one flag per block,
which llama.cpp reads in place of the index rule. A slice of global layers only has no window
at all (llama.cpp refuses a window that no layer uses).

A slice that is not the model's last may also keep only the first ``vocab`` entries of the
vocabulary, and so of ``token_embd`` and ``output``: llama.cpp computes the output head for
every row of every slice (its graph ends in it), and Gemma 3's head of 262,144 rows costs as
much as 30 of its blocks. Such a slice takes hidden states or embeddings as input, never
token ids beyond ``vocab``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import gguf

__all__ = ["cache_dir", "slice_model", "source_digest"]

CACHE_ENV = "STAGERUN_LLAMACPP_CACHE"
_VOCABULARY_ARRAYS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}
)


def cache_dir() -> Path:
    """``$STAGERUN_LLAMACPP_CACHE``, else ``~/.cache/stagerun/llamacpp``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "stagerun" / "llamacpp"


def source_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def slice_model(
    source: Path,
    lo: int,
    hi: int,
    *,
    directory: Path | None = None,
    local: Sequence[bool] | None = None,
    vocab: int | None = None,
) -> Path:
    """The path of a GGUF with blocks ``lo..hi-1`` of ``source`` (written if not cached).

    ``local`` flags which of the source's blocks use its sliding window (every block's, from
    `stagerun.model.ModelConfig.is_local`); None leaves the source's keys as they are.
    ``vocab`` keeps the first entries of the vocabulary and of the embedding and output
    matrices (every special token id must lie below it); None keeps them all.
    """
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    pattern = None if local is None or not any(local) else [bool(x) for x in local[lo:hi]]
    drop_window = pattern is not None and not any(pattern)
    tag = "" if pattern is None else "-global" if drop_window else "-swa"
    tag += "" if vocab is None else f"-vocab{vocab}"
    target = directory / f"{source_digest(source)[:16]}-layers-{lo}-{hi}{tag}.gguf"
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    partial = target.with_suffix(f".{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            writer.add_uint32(name, hi - lo)
            continue
        if name == f"{arch}.attention.sliding_window_pattern" and pattern is not None:
            continue  # written below, for the slice's blocks
        if name == f"{arch}.attention.sliding_window" and drop_window:
            continue
        vtype = field.types[0]
        value = field.contents()
        if vocab is not None and name in _VOCABULARY_ARRAYS:
            value = value[:vocab]
        if vocab is not None and name == f"{arch}.vocab_size":
            value = vocab
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    if pattern is not None and not drop_window:
        writer.add_array(f"{arch}.attention.sliding_window_pattern", pattern)
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if not lo <= index < hi:
                continue
            name = f"blk.{index - lo}." + name.split(".", 2)[2]
        data = tensor.data
        if vocab is not None and name in ("token_embd.weight", "output.weight"):
            data = data[:vocab]  # rows of the matrix, each a run of whole blocks
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target
