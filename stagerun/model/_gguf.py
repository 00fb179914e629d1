"""Reading a GGUF file of a known family: its shape, its tokenizer, and one stage's weights.

Theory of operation: ``open_model`` memory-maps the file with ``gguf.GGUFReader`` (which parses
every key and tensor header up front, about 2 s for the default model because of its 49k-entry
vocabulary) and checks that it is a model of a known family (`stagerun.model._families`:
llama, qwen2, qwen3) whose tensors ``gguf.quants`` can dequantize.
Before that, `check_gguf_header` walks the header once, cheaply, and refuses counts and lengths
the file cannot hold or that pass the ``MAX_GGUF_*`` bounds: the reader spends ~1 KiB and ~12 us
on every array item, so a hostile 50-byte file announcing millions of them would cost seconds
and gigabytes. Nothing is dequantized then. ``ModelFile.load_weights(lo, hi, ...)``
dequantizes only the tensors of one stage -- the blocks ``lo..hi-1``, plus the embeddings for
the first stage and the output norm and head for the last -- into float32 ``(out, in)`` arrays,
the orientation a PyTorch ``nn.Linear`` uses. A tied model (no ``output.weight``) reuses ``token_embd`` as the head.
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import gguf
import numpy as np
import numpy.typing as npt

from .._errors import LayerRangeError, ModelError, UnsupportedModelError
from ._chat import CHATML_TEMPLATE, render_chat
from ._families import FAMILIES, Family
from ._resolve import resolve_model
from ._tokenizer import Tokenizer, eog_ids_from_vocab

__all__ = [
    "LayerWeights",
    "ModelConfig",
    "ModelFile",
    "QuantizedTensor",
    "StageWeights",
    "open_model",
]

F32 = npt.NDArray[np.float32]

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# Bounds on a GGUF header, checked before gguf.GGUFReader walks it: the reader builds numpy
# objects for every array item (~12 us and ~1 KiB each), so a few bytes announcing a long array
# cost seconds and gigabytes. Every count must also fit in the bytes the file has left.
MAX_GGUF_KEYS = 1 << 16  # real models carry 30-60 metadata keys
MAX_GGUF_TENSORS = 1 << 16  # a 30-layer llama has 272 tensors, the largest MoE files a few 1000
MAX_GGUF_KEY_BYTES = 65535  # the GGUF spec's limit on a key's length
MAX_GGUF_ARRAY_ITEMS = 1 << 20  # 4x Gemma 3's 262,144-token vocabulary (SmolLM2: 49,152)
MAX_GGUF_METADATA_ITEMS = 1 << 21  # all arrays together: Gemma 3's tokens+scores+types ~786k
MAX_GGUF_ARRAY_DEPTH = 2  # arrays of arrays, at most; no model nests deeper
MAX_GGUF_DIMS = 4  # GGML_MAX_DIMS

_LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


@attrs.frozen
class ModelConfig:
    """The shape of a model, read from its GGUF metadata."""

    name: str
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    context_length: int
    tied_output: bool
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    family: Family = FAMILIES["llama"]  # the block layout (`stagerun.model._families`)


@attrs.frozen(eq=False)
class LayerWeights:
    """One transformer block, float32, matrices as ``(out, in)``."""

    attn_norm: F32
    wq: F32
    wk: F32
    wv: F32
    wo: F32
    ffn_norm: F32
    w_gate: F32
    w_up: F32
    w_down: F32
    bq: F32 | None = None  # the family's extras (`Family.extra_tensors`), in that order
    bk: F32 | None = None
    bv: F32 | None = None
    q_norm: F32 | None = None
    k_norm: F32 | None = None


@attrs.frozen(eq=False)
class StageWeights:
    """The weights one stage needs: blocks ``lo..hi-1`` and, maybe, the ends of the model.

    ``output`` is the very same array as ``token_embd`` for a tied model that loads both.
    ``tensor_names`` lists what was dequantized from the file.
    """

    lo: int
    hi: int
    layers: tuple[LayerWeights, ...]
    token_embd: F32 | None
    output_norm: F32 | None
    output: F32 | None
    tensor_names: frozenset[str]


@attrs.frozen(eq=False)
class QuantizedTensor:
    """A 2-D tensor as the file stores it: ``shape[0]`` rows of GGUF blocks.

    ``data`` is a read-only ``uint8`` view of the mapped file, one row of blocks per output row
    (``shape`` is ``(out, in)``, like the dequantized matrices); ``qtype`` is the GGML type
    name (``"Q4_1"``, ``"Q8_0"``, ``"F32"``...).
    """

    name: str
    qtype: str
    shape: tuple[int, int]
    data: npt.NDArray[np.uint8]


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


class ModelFile:
    """An open GGUF model file. Use :func:`open_model` to make one."""

    def __init__(self, path: pathlib.Path, reader: gguf.GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self.config = self._read_config()
        self._check_tensors()
        template = _field(reader, "tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._sha256: str | None = None

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<ModelFile {c.name!r} arch={c.architecture} layers={c.n_layers} "
            f"d_model={c.d_model} vocab={c.vocab_size} path={str(self.path)!r}>"
        )

    # -- metadata -------------------------------------------------------------------------

    def _get(self, key: str, default: Any = ...) -> Any:
        value = _field(self._reader, key)
        if value is None:
            if default is ...:
                raise ModelError(f"{self.path} lacks the GGUF key {key!r}; the file is incomplete.")
            return default
        return value

    def _read_config(self) -> ModelConfig:
        arch = self._get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path.name} is a {arch!r} model; stagerun runs only "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models."
            )
        d_model = int(self._get(f"{arch}.embedding_length"))
        n_heads = int(self._get(f"{arch}.attention.head_count"))
        head_dim = int(self._get(f"{arch}.attention.key_length", d_model // n_heads))
        rope_dims = int(self._get(f"{arch}.rope.dimension_count", head_dim))
        scaling = self._get(f"{arch}.rope.scaling.type", "none")
        if rope_dims != head_dim or scaling != "none" or "rope_freqs.weight" in self._tensors:
            raise UnsupportedModelError(
                f"{self.path.name} uses partial or scaled RoPE, which stagerun does not support."
            )
        context = int(self._get(f"{arch}.context_length", 2048))
        window = int(self._get(f"{arch}.attention.sliding_window", 0) or 0)
        if 0 < window < context:
            raise UnsupportedModelError(
                f"{self.path.name} uses sliding-window attention ({window} of {context} "
                "positions), which stagerun does not support yet."
            )
        tokens = self._get("tokenizer.ggml.tokens", [])
        embd = self._tensors.get("token_embd.weight")
        vocab = self._get(
            f"{arch}.vocab_size", len(tokens) or (int(embd.shape[1]) if embd is not None else 0)
        )
        bos = self._get("tokenizer.ggml.bos_token_id", None)
        eos = self._get("tokenizer.ggml.eos_token_id", None)
        extra = [self._get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eot", "eom")]
        return ModelConfig(
            name=str(self._get("general.name", self.path.stem)),
            architecture=arch,
            n_layers=int(self._get(f"{arch}.block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(self._get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            d_ff=int(self._get(f"{arch}.feed_forward_length")),
            vocab_size=int(vocab),
            rope_base=float(self._get(f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(self._get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=context,
            tied_output="output.weight" not in self._tensors,
            bos_id=None if bos is None else int(bos),
            eos_id=None if eos is None else int(eos),
            eog_ids=eog_ids_from_vocab(tokens, [eos, *extra]),
            family=FAMILIES[arch],
        )

    def _check_tensors(self) -> None:
        c = self.config
        names = ["token_embd.weight", "output_norm.weight"]
        names += [f"blk.{i}.{t}.weight" for i in range(c.n_layers) for t in _LAYER_TENSORS]
        names += [f"blk.{i}.{t}" for i in range(c.n_layers) for t in c.family.extra_tensors()]
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise ModelError(
                f"{self.path.name} lacks {len(missing)} tensors the {c.family.name} layout "
                f"needs (first: {missing[0]!r})."
            )
        known = getattr(gguf.quants, "_type_traits", None)
        if known is None:  # gguf changed its internals: leave the check to load time
            return
        plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        for t in self._reader.tensors:
            if t.tensor_type not in plain and t.tensor_type not in known:
                raise _unsupported_type(self.path, t.name, t.tensor_type)

    # -- tokenizer and chat -----------------------------------------------------------------

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, built from the GGUF vocabulary on first use."""
        return Tokenizer.from_gguf_fields(
            model=self._get("tokenizer.ggml.model", None),
            pre=self._get("tokenizer.ggml.pre", None),
            tokens=self._get("tokenizer.ggml.tokens", []),
            token_types=self._get("tokenizer.ggml.token_type", []),
            merges=self._get("tokenizer.ggml.merges", []),
            bos_id=self.config.bos_id,
            eos_id=self.config.eos_id,
            eog_ids=self.config.eog_ids,
            add_bos=bool(self._get("tokenizer.ggml.add_bos_token", False)),
            source=self.path.name,
        )

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render messages with the model's chat template (ChatML when the file has none)."""
        tok = self.tokenizer
        return render_chat(
            self.chat_template or CHATML_TEMPLATE,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.token_text(tok.bos_id),
            eos_token=tok.token_text(tok.eos_id),
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Render messages and tokenize them, as the prompt of a chat completion.

        Control tokens in the rendered text become their ids; no BOS is prepended, because a
        template that wants one writes it itself (Hugging Face does the same).
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, special=True, add_bos=False)

    # -- weights ----------------------------------------------------------------------------

    def check_layers(self, lo: int, hi: int) -> None:
        """Raise LayerRangeError unless ``0 <= lo < hi <= n_layers``."""
        n = self.config.n_layers
        if not (0 <= lo < hi <= n):
            raise LayerRangeError(
                f"layer range [{lo}, {hi}) is not a non-empty part of [0, {n}); "
                f"the model has {n} layers."
            )

    def _tensor(self, name: str) -> F32:
        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise _unsupported_type(self.path, name, t.tensor_type) from exc
        return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)

    def quantized(self, name: str) -> QuantizedTensor:
        """The 2-D tensor ``name`` in its stored blocks, for backends with their own kernels."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name} has no tensor {name!r}.")
        if len(t.shape) != 2:
            raise ModelError(f"{name!r} in {self.path.name} is not a matrix (shape {t.shape}).")
        rows, cols = int(t.shape[1]), int(t.shape[0])
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        return QuantizedTensor(name=name, qtype=t.tensor_type.name, shape=(rows, cols), data=data)

    def load_tensor(self, name: str) -> F32:
        """Dequantize one tensor to float32 (a matrix as ``(out, in)``)."""
        if name not in self._tensors:
            raise ModelError(f"{self.path.name} has no tensor {name!r}.")
        return self._tensor(name)

    def load_weights(
        self, lo: int, hi: int, *, embeddings: bool, head: bool, blocks: bool = True
    ) -> StageWeights:
        """Dequantize the weights of blocks ``lo..hi-1`` and, if asked, the model's ends.

        Args:
            lo: first block, inclusive.
            hi: last block, exclusive.
            embeddings: load ``token_embd`` (the first stage needs it).
            head: load the output norm and head (the last stage needs them).
            blocks: False loads only the ends (``layers`` is then empty), for a backend that
                reads the blocks in their stored form (`quantized`).
        """
        self.check_layers(lo, hi)
        loaded: list[str] = []

        def get(name: str) -> F32:
            loaded.append(name)
            return self._tensor(name)

        family = self.config.family

        def block(i: int) -> LayerWeights:
            weights = [get(f"blk.{i}.{t}.weight") for t in _LAYER_TENSORS]
            extras = {t: get(f"blk.{i}.{t}") for t in family.extra_tensors()}
            return attrs.evolve(
                LayerWeights(*weights),
                bq=extras.get("attn_q.bias"),
                bk=extras.get("attn_k.bias"),
                bv=extras.get("attn_v.bias"),
                q_norm=extras.get("attn_q_norm.weight"),
                k_norm=extras.get("attn_k_norm.weight"),
            )

        layers = tuple(block(i) for i in range(lo, hi) if blocks)
        tied = self.config.tied_output
        embd = get("token_embd.weight") if embeddings or (head and tied) else None
        output: F32 | None = None
        if head:
            output = embd if tied else get("output.weight")
        return StageWeights(
            lo=lo,
            hi=hi,
            layers=layers,
            token_embd=embd if embeddings else None,
            output_norm=get("output_norm.weight") if head else None,
            output=output,
            tensor_names=frozenset(loaded),
        )

    def tensor_names(self) -> list[str]:
        """Names of every tensor in the file, in file order."""
        return list(self._tensors)

    def sha256(self) -> str:
        """Hex SHA-256 of the file (streamed, computed once)."""
        if self._sha256 is None:
            digest = hashlib.sha256()
            with self.path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            self._sha256 = digest.hexdigest()
        return self._sha256


def _unsupported_type(path: pathlib.Path, name: str, qtype: Any) -> UnsupportedModelError:
    kind = getattr(qtype, "name", str(qtype))
    return UnsupportedModelError(
        f"{path.name}: tensor {name!r} has type {kind}, which gguf cannot dequantize."
    )


def open_model(name_or_path: str | os.PathLike[str] | ModelFile) -> ModelFile:
    """Open a model by name (``smollm2``) or GGUF path; nothing is dequantized yet.

    A `ModelFile` is returned as it is.

    Raises:
        ModelNotFoundError: see :func:`resolve_model`.
        ModelError: the file is not a readable GGUF file, or lacks what a llama model needs.
        UnsupportedModelError: the architecture is not llama, or a tensor type is unknown.
    """
    if isinstance(name_or_path, ModelFile):
        return name_or_path
    path = resolve_model(name_or_path)
    stat = path.stat()
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: pathlib.Path, _mtime_ns: int, _size: int) -> ModelFile:
    # Parsing the header and 49k vocabulary entries takes ~2 s; a process that opens the same
    # unchanged file again (several in-process stages, tests) reuses the read-only ModelFile.
    try:
        check_gguf_header(path)
        reader = gguf.GGUFReader(path, "r")
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"{path} is not a readable GGUF file ({exc}).") from exc
    return ModelFile(path, reader)


# -- header bounds ------------------------------------------------------------------------

_STRING, _ARRAY = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.ARRAY)
_SCALAR_BYTES = {int(t): np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
_MIN_ITEM_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}  # an empty string or array
_BLOCKS = {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}  # elements, bytes


def check_gguf_header(path: pathlib.Path) -> None:
    """Walk the header of the GGUF file ``path`` and refuse sizes it cannot hold.

    Reads lengths and counts only, building nothing, in time linear in the header's bytes:
    every count of keys, tensors, array items and bytes must fit in what the file has left and
    stay under the ``MAX_GGUF_*`` bounds. A file that is not GGUF v2/v3 is left to the reader.

    Raises:
        ModelError: a count or length is over a bound or runs past the end of the file.
    """
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size < 8:
            raise ModelError(f"{path} is not a readable GGUF file (it is too short).")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            # A version with its low half zero was written on a machine of the other byte order.
            order: Literal["little", "big"] = "little"
            if int.from_bytes(data[4:8], order) & 0xFFFF == 0:
                order = "big"
            if int.from_bytes(data[4:8], order) not in (2, 3):
                return
            try:
                _HeaderWalk(data, order).walk()
            except _HeaderError as exc:
                raise ModelError(f"{path} is not a usable GGUF file: {exc}.") from None


class _HeaderError(Exception):
    pass


class _HeaderWalk:
    """A cursor over a GGUF header that checks each length before it is used."""

    def __init__(self, data: mmap.mmap, order: Literal["little", "big"]) -> None:
        self.data, self.order = data, order
        self.offset = 8  # past the magic and the version
        self.items = 0

    def walk(self) -> None:
        n_tensors = self.count("the tensor count", 32, MAX_GGUF_TENSORS)
        n_keys = self.count("the metadata key count", 13, MAX_GGUF_KEYS)
        for _ in range(n_keys):
            key = self.string("a metadata key", MAX_GGUF_KEY_BYTES)
            self.value(self.uint(4, f"the type of {key!r}"), repr(key), 0)
        for _ in range(n_tensors):
            name = self.string("a tensor name", MAX_GGUF_KEY_BYTES)
            n_dims = self.uint(4, f"tensor {name!r}'s dimension count")
            if not 1 <= n_dims <= MAX_GGUF_DIMS:
                raise _HeaderError(
                    f"tensor {name!r} has {n_dims} dimensions, not 1 to {MAX_GGUF_DIMS}"
                )
            dims = [self.uint(8, f"tensor {name!r}'s shape") for _ in range(n_dims)]
            qtype = self.uint(4, f"tensor {name!r}'s type")
            start = self.uint(8, f"tensor {name!r}'s offset")
            block = _BLOCKS.get(qtype)
            size = math.prod(dims) * block[1] // block[0] if block else 0
            if start + size > len(self.data):
                raise _HeaderError(
                    f"tensor {name!r} of shape {dims} needs {size} bytes at data offset "
                    f"{start}, but the file holds {len(self.data)}"
                )

    def take(self, n: int, what: str) -> int:
        start, left = self.offset, len(self.data) - self.offset
        if n > left:
            raise _HeaderError(f"{what} needs {n} bytes at offset {start}; only {left} follow")
        self.offset += n
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.take(size, what)
        return int.from_bytes(self.data[start : start + size], self.order)

    def count(self, what: str, item_bytes: int, bound: int) -> int:
        n = self.uint(8, what)
        room = (len(self.data) - self.offset) // item_bytes
        if n > room:
            raise _HeaderError(f"{what} is {n}, but the rest of the file holds at most {room}")
        if n > bound:
            raise _HeaderError(f"{what} is {n}, more than the limit of {bound}")
        return n

    def string(self, what: str, bound: int) -> str:
        n = self.count(f"the length of {what}", 1, bound)
        start = self.take(n, what)
        return self.data[start : start + min(n, 60)].decode("utf-8", "replace")

    def value(self, vtype: int, what: str, depth: int) -> None:
        if vtype in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[vtype], what)
        elif vtype == _STRING:
            self.string(what, len(self.data))
        elif vtype == _ARRAY and depth < MAX_GGUF_ARRAY_DEPTH:
            itype = self.uint(4, f"the item type of {what}")
            item_bytes = _MIN_ITEM_BYTES.get(itype, 1)
            n = self.count(f"the length of {what}", item_bytes, MAX_GGUF_ARRAY_ITEMS)
            self.items += n
            if self.items > MAX_GGUF_METADATA_ITEMS:
                raise _HeaderError(
                    f"the metadata arrays hold more than {MAX_GGUF_METADATA_ITEMS} items "
                    f"(at {what})"
                )
            if itype in _SCALAR_BYTES:
                self.take(n * _SCALAR_BYTES[itype], what)
            else:
                for _ in range(n):
                    self.value(itype, f"an item of {what}", depth + 1)
        elif vtype == _ARRAY:
            raise _HeaderError(f"{what} nests arrays deeper than {MAX_GGUF_ARRAY_DEPTH}")
        else:
            raise _HeaderError(f"{what} has the unknown value type {vtype}")
