"""A copy of a GGUF without its vocabulary, for loading the model into transformers quickly.

transformers reads a GGUF with gguf-py's reader, which builds two numpy views per item of
every array: for Gemma 3's 262,144-token vocabulary (tokens, scores, types) that is most of a
38 s model load, paid again for each fixture that loads it. The reference models here never
read the vocabulary (the tests tokenize with stagerun's tokenizer, or with a transformers
tokenizer loaded from the original file), so they load from a copy that has every tensor
byte for byte and every other field, without the vocabulary arrays and with
``{arch}.vocab_size`` said outright (transformers otherwise counts the tokens for it).
Measured: Gemma 3's load 38.3 s -> 8.0 s, SmolLM2's 15.4 s -> 7.8 s, logits bitwise the same.
"""

from __future__ import annotations

import pathlib
from typing import Any

import gguf
import numpy as np

from stagerun.model._gguf_file import GgufReader, StringArray

# The vocabulary's arrays: what a model's weights do not need.
VOCABULARY = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
}


def transformers_model(source: pathlib.Path, folder: pathlib.Path) -> Any:
    """transformers' float32 model of ``source``, loaded from its weights-only copy in
    ``folder`` (deleted once loaded: the model holds its own tensors)."""
    import torch
    import transformers

    copy = weights_only_copy(source, folder)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(copy.parent), gguf_file=copy.name, dtype=torch.float32
        )
    finally:
        copy.unlink()


def weights_only_copy(source: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """Write ``folder/<source name>``: ``source`` without its vocabulary arrays (see above)."""
    reader = GgufReader(source)
    arch = str(GgufReader.value(reader.fields["general.architecture"]))
    target = folder / source.name
    writer = gguf.GGUFWriter(target, arch)
    vocab_size = len(GgufReader.value(reader.fields["tokenizer.ggml.tokens"]))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in VOCABULARY:
            continue
        _copy_field(writer, key, field)
    if f"{arch}.vocab_size" not in reader.fields:
        writer.add_uint32(f"{arch}.vocab_size", vocab_size)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        writer.add_tensor_info(
            tensor.name, data.shape, data.dtype, data.nbytes, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(np.asarray(tensor.data))
    writer.close()
    _check_copy(reader, GgufReader(target))
    return target


def _copy_field(writer: gguf.GGUFWriter, key: str, field: Any) -> None:
    value = GgufReader.value(field)
    kind = field.types[0]
    if kind != gguf.GGUFValueType.ARRAY:
        writer.add_key_value(key, value, kind)
        return
    items = list(value) if isinstance(value, StringArray) else np.asarray(value).tolist()
    writer.add_key_value(key, items, kind, sub_type=field.types[1])


def _check_copy(original: GgufReader, copy: GgufReader) -> None:
    """The copy has every tensor of the original, byte for byte, and every kept field."""
    assert [t.name for t in copy.tensors] == [t.name for t in original.tensors]
    for ours, theirs in zip(copy.tensors, original.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert list(ours.shape) == list(theirs.shape), ours.name
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data)), ours.name
    kept = set(original.fields) - VOCABULARY
    assert kept <= set(copy.fields), sorted(kept - set(copy.fields))
