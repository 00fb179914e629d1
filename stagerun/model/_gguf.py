"""Reading a GGUF file of a known family: its shape, its tokenizer, and one stage's weights.

Theory of operation: ``open_model`` memory-maps the file with ``gguf.GGUFReader`` (which parses
every key and tensor header up front, about 2 s for the default model because of its 49k-entry
vocabulary) and checks that it is a model of a known family (`stagerun.model._families`:
llama, qwen2, qwen3, phi3, gemma3, or one a plugin registers) whose tensors ``gguf.quants`` can
dequantize (F32, F16, BF16, the legacy Q4_0...Q8_0 and the K-quants Q2_K...Q6_K).
Before that, `check_gguf_header` walks the header once, cheaply, and refuses counts and lengths
the file cannot hold or that pass the ``MAX_GGUF_*`` bounds (keys, tensors, array items, nested
arrays): the reader spends kilobytes and tens of microseconds on each key, tensor and nested
array, so a hostile file announcing millions of them would cost minutes and gigabytes. The
walk notes where the vocabulary's strings lie, and the reader takes them from it rather than
walking them again. Nothing is dequantized then. ``ModelFile.load_weights(lo, hi, ...)``
dequantizes only the tensors of one stage -- the blocks ``lo..hi-1``, plus the embeddings for
the first stage and the output norm and head for the last -- into float32 ``(out, in)`` arrays,
the orientation a PyTorch ``nn.Linear`` uses. A tied model (no ``output.weight``) reuses
``token_embd`` as the head.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from .._errors import LayerRangeError, ModelError, UnsupportedModelError
from .._util import release_free_memory
from ._chat import ChatTemplateError, render_chat
from ._families import FAMILIES, Family
from ._gguf_file import MAX_GGUF_ARRAY_ITEMS as MAX_GGUF_ARRAY_ITEMS
from ._gguf_file import GgufReader, check_gguf_header
from ._resolve import resolve_model
from ._tokenizer import Tokenizer, eog_ids_from_vocab
from ._values import LayerWeights, ModelConfig, QuantizedTensor, StageWeights, StoredTensor

__all__ = [
    "LayerWeights",
    "ModelConfig",
    "ModelFile",
    "QuantizedTensor",
    "StageWeights",
    "StoredTensor",
    "open_model",
]

F32 = npt.NDArray[np.float32]
ROPE_SCALINGS = ("none", "linear")  # rope_freqs.weight (Llama 3's factors) is read apart


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else GgufReader.value(field)


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
        family = family_of(str(arch), self.path.name)
        d_model = int(self._get(f"{arch}.embedding_length"))
        n_heads = int(self._get(f"{arch}.attention.head_count"))
        head_dim = int(self._get(f"{arch}.attention.key_length", d_model // n_heads))
        value_dim = int(self._get(f"{arch}.attention.value_length", head_dim))
        rope_dims = int(self._get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dims != head_dim or value_dim != head_dim:
            raise UnsupportedModelError(
                f"{self.path.name} rotates {rope_dims} of {head_dim} dimensions per head, or its "
                f"values have {value_dim}; stagerun runs full RoPE over equal key and value sizes."
            )
        scaling = str(self._get(f"{arch}.rope.scaling.type", "none"))
        longrope = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight")
                    if n in self._tensors]  # fmt: skip
        if scaling not in ROPE_SCALINGS or longrope:
            raise UnsupportedModelError(
                f"{self.path.name} uses {scaling if not longrope else 'LongRoPE'} RoPE scaling; "
                f"stagerun supports {', '.join(ROPE_SCALINGS)} and Llama 3's rope_freqs."
            )
        factor = float(self._get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        context = int(self._get(f"{arch}.context_length", 2048))
        window = int(self._get(f"{arch}.attention.sliding_window", 0) or 0)
        local_base = self._get(f"{arch}.rope.freq_base_swa", family.local_rope_base)
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
            family=family,
            sliding_window=window if 0 < window < context else 0,
            local_rope_base=None if local_base is None else float(local_base),
            rope_scale=factor if scaling == "linear" else 1.0,
            rope_factors="rope_freqs.weight" in self._tensors,
            attn_softcap=float(self._get(f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
            final_softcap=float(self._get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        )

    def _check_tensors(self) -> None:
        c = self.config
        names = ["token_embd.weight", "output_norm.weight"]
        names += [f"blk.{i}.{t}" for i in range(c.n_layers) for t in c.family.layer_tensors()]
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
        model = self._get("tokenizer.ggml.model", None)
        unknown = self._get("tokenizer.ggml.unknown_token_id", None)
        tokenizer = Tokenizer.from_gguf_fields(
            model=model,
            pre=self._get("tokenizer.ggml.pre", None),
            tokens=self._get("tokenizer.ggml.tokens", []),
            token_types=self._get("tokenizer.ggml.token_type", []),
            merges=self._get("tokenizer.ggml.merges", []),
            scores=self._get("tokenizer.ggml.scores", []),
            unknown_id=None if unknown is None else int(unknown),
            # llama.cpp's defaults when a file omits them: a SentencePiece vocabulary adds BOS
            # and a space prefix, a byte-level one neither.
            add_space_prefix=bool(self._get("tokenizer.ggml.add_space_prefix", True)),
            bos_id=self.config.bos_id,
            eos_id=self.config.eos_id,
            eog_ids=self.config.eog_ids,
            add_bos=bool(self._get("tokenizer.ggml.add_bos_token", model == "llama")),
            source=self.path.name,
        )
        release_free_memory()  # building it took as much again (Gemma 3: 30 MB), now free
        return tokenizer

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render messages with ``template``, else the model's chat template.

        The model's is the file's ``tokenizer.chat_template``, else its family's
        (`Family.chat_template`). ``extra`` are further template variables (``tools``).

        Raises:
            ChatTemplateError: there is no template (a base model, like Gemma 3 270M), or it
                refused the messages.
        """
        tok = self.tokenizer
        template = self.template_for_chat(template)
        if template is None:
            raise ChatTemplateError(
                f"{self.path.name} has no chat template (it may be a base model, which "
                "continues text rather than chats); send a completion request instead, or "
                "give the server a template with --chat-template FILE"
            )
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.token_text(tok.bos_id),
            eos_token=tok.token_text(tok.eos_id),
            **extra,
        )

    def template_for_chat(self, template: str | None = None) -> str | None:
        """The chat template `render_chat` uses: ``template``, the file's, or the family's."""
        return template or self.chat_template or self.config.family.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> list[int]:
        """Render messages and tokenize them, as the prompt of a chat completion.

        Control tokens in the rendered text become their ids; no BOS is prepended, because a
        template that wants one writes it itself (Hugging Face does the same).
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template=template
        )
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

    def stored(self, name: str) -> StoredTensor:
        """Where tensor ``name`` lies in the file, as stored (for backends that compute on it).

        Its bytes are ``mapping[offset : offset + nbytes]``; ``ne`` is its shape in ggml's
        order (row length first), ``qtype`` the ggml type number.
        """
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name} has no tensor {name!r}.")
        return StoredTensor(
            name=name,
            qtype=int(t.tensor_type),
            ne=tuple(int(d) for d in t.shape),
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )

    @property
    def mapping(self) -> npt.NDArray[np.uint8]:
        """The whole file, mapped read-only (pages are read as they are touched)."""
        data: npt.NDArray[np.uint8] = self._reader.data
        return data

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

        c = self.config
        q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

        def block(i: int) -> LayerWeights:
            t = {name: get(f"blk.{i}.{name}") for name in family.layer_tensors()}
            if family.fused_qkv:  # Phi-3: [W_q; W_k; W_v] in one matrix
                qkv = t.pop("attn_qkv.weight")
                t["attn_q.weight"] = qkv[:q_rows]
                t["attn_k.weight"] = qkv[q_rows : q_rows + kv_rows]
                t["attn_v.weight"] = qkv[q_rows + kv_rows :]
            if family.fused_gate_up:  # Phi-3: [W_gate; W_up] in ffn_up
                gate_up = t.pop("ffn_up.weight")
                t["ffn_gate.weight"], t["ffn_up.weight"] = np.split(gate_up, 2)
            return LayerWeights(
                attn_norm=t["attn_norm.weight"],
                wq=t["attn_q.weight"],
                wk=t["attn_k.weight"],
                wv=t["attn_v.weight"],
                wo=t["attn_output.weight"],
                ffn_norm=t["ffn_norm.weight"],
                w_gate=t["ffn_gate.weight"],
                w_up=t["ffn_up.weight"],
                w_down=t["ffn_down.weight"],
                bq=t.get("attn_q.bias"),
                bk=t.get("attn_k.bias"),
                bv=t.get("attn_v.bias"),
                q_norm=t.get("attn_q_norm.weight"),
                k_norm=t.get("attn_k_norm.weight"),
                post_attn_norm=t.get("post_attention_norm.weight"),
                post_ffn_norm=t.get("post_ffw_norm.weight"),
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

    def rope_factors(self) -> F32 | None:
        """Llama 3's RoPE frequency divisors (``rope_freqs.weight``, ``head_dim/2``), if any."""
        return self._tensor("rope_freqs.weight") if self.config.rope_factors else None

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


def family_of(architecture: str, source: str = "the model") -> Family:
    """The family that runs ``general.architecture``: a built-in, else a plugin's.

    Raises:
        UnsupportedModelError: no built-in family nor installed plugin has that name (or the
            plugin is broken: the message says why).
    """
    built_in = FAMILIES.get(architecture)
    if built_in is not None:
        return built_in
    from .. import plugins  # the registry imports nothing of the model's

    try:
        family: Family = plugins.family(architecture)
    except plugins.PluginError as exc:
        registered = any(i.name == architecture for i in plugins.installed("architectures"))
        known = ", ".join(sorted({*FAMILIES, *plugins.names("architectures")}))
        why = f" ({exc})" if registered else ""
        raise UnsupportedModelError(
            f"{source} is a {architecture!r} model{why}; stagerun runs {known} models, and "
            "a stagerun.architectures plugin can add more (docs/models.md)."
        ) from exc
    return family


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
        ModelError: the file is not a readable GGUF file, or lacks what its family needs.
        UnsupportedModelError: no installed family takes the file's architecture (built in:
            llama, qwen2, qwen3, phi3, gemma3; see `stagerun plugins`), or a tensor type is
            unknown.
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
        strings = check_gguf_header(path)
        reader = GgufReader(path, "r", strings=strings)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"{path} is not a readable GGUF file ({exc}).") from exc
    return ModelFile(path, reader)
