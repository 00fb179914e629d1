"""One stage's layers in llama.cpp, through llama-cpp-python's low-level API.

Theory of operation: the stage loads a GGUF slice holding only its blocks (`_slice`), so
llama.cpp computes exactly the stage's layer range in its own (quantized) kernels:

* **input**: the first stage passes token ids; the others pass the previous stage's hidden
  states as the batch's embedding input (``llama_batch_init(T, n_embd, 1)``, rows copied into
  ``batch.embd``), which llama.cpp feeds to block 0 in place of the token embeddings;
  llama.cpp's ``gemma`` and ``gemma2`` graphs multiply that input by ``sqrt(d_model)`` as
  they do token embeddings (``gemma3`` only scales tokens), so a later stage of those
  divides its hidden rows by it first (`SCALES_HIDDEN_INPUT`);
* **output**: the last stage reads logits; the others read the output of their last block,
  ``l_out-{n-1}``, from the graph through the eval callback, which copies the tensor out with
  ``ggml_backend_tensor_get``. Every row must request an output, or llama.cpp prunes the last
  block to the rows whose logits were asked for;
* **KV cache**: a sequence id in a llama.cpp context shared by up to ``seats`` sessions
  (`_context.SharedContext`; one by default), trimmed with ``llama_memory_seq_rm``;
  positions are absolute, like every stagerun backend. More sessions open more contexts.
* **batches**: `LlamaCppBackend.forward_batch` puts the rows of every session of a context
  into one ``llama_batch``, each row with its sequence id and position, and runs one
  ``llama_decode`` per context; `forward` is a batch of one. With one seat a context (the
  default) every session is its own decode, as before batches existed. With more, a
  session's result in a batch is close to, not bitwise, its result alone: llama.cpp's
  kernels pick their path by the number of rows, and its 8-bit activations turn the smallest
  difference into a rounding step. Default model (Q4_1), 4 sessions, 32 decode steps: logits
  correlate at 0.9988 or better, as with numpy's, and give the same greedy token at 125 of
  128 steps, the others near-ties.

``should_stop`` is polled per item before the graph and, through the same eval callback,
after every block's output ``l_out-i`` (only while a ``should_stop`` is given: each observed
tensor splits the graph). An item that stops is trimmed back to its position and its result is
the `ComputeCancelled` (its rows run to the end of the graph, unused); when every item has
stopped the callback stops the graph. Blocking code, called from one worker thread at a time.
"""

from __future__ import annotations

import ctypes
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import gguf
import llama_cpp
import numpy as np
import numpy.typing as npt

from stagerun import ComputeCancelled
from stagerun.abc import ComputeBackend, ForwardItem
from stagerun.backends import GgufLayers, check_positions, forward_one, stage_input
from stagerun.model import ModelFile

from ._context import Run, SharedContext
from ._slice import slice_model

__all__ = ["LlamaCppBackend", "LlamaCppCache"]

DEFAULT_CONTEXT = 2048
DEFAULT_SEATS = 1
SEATS_ENV = "STAGERUN_LLAMACPP_SEATS"
# Architectures whose llama.cpp graph scales its input by sqrt(d_model) even when the input is
# hidden states (models/gemma.cpp, gemma2.cpp; gemma3.cpp scales token input only).
SCALES_HIDDEN_INPUT = frozenset({"gemma", "gemma2"})
_backend_ready = False


HEADLESS_VOCAB = 1024  # the vocabulary a non-last slice keeps, when its special tokens fit


def _headless_vocab(model: ModelFile) -> int | None:
    """How much vocabulary a slice without a head keeps: None for all of it.

    llama.cpp's vocabulary loader looks up the special tokens (and, for SentencePiece, the
    byte tokens such as ``<0x0A>``), so they must all fall below the cut; a vocabulary not
    much larger than the cut is kept whole.
    """
    c = model.config
    if c.vocab_size <= 4 * HEADLESS_VOCAB:
        return None
    ids = [c.bos_id, c.eos_id, *c.eog_ids]
    ids += [model._get(f"tokenizer.ggml.{k}_token_id", None) for k in ("unknown", "padding")]
    if model._get("tokenizer.ggml.model", None) == "llama":  # SentencePiece: the byte tokens
        tokens = model._get("tokenizer.ggml.tokens", [])
        ids.append(tokens.index("<0xFF>") if "<0xFF>" in tokens else len(tokens))
    if any(i is not None and int(i) >= HEADLESS_VOCAB for i in ids):
        return None
    return HEADLESS_VOCAB


def _ggml_base() -> ctypes.CDLL:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:  # pragma: no cover - a build without a separate ggml-base library
        lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
    ]  # fmt: skip
    return lib


_ggml: ctypes.CDLL | None = None


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _quiet(level: int, text: bytes, user_data: Any) -> None:
    """Drop llama.cpp's log lines (a module-level object: the C side keeps the pointer)."""


class LlamaCppCache:
    """One request's KV cache on one stage: a sequence id in a shared llama.cpp context."""

    def __init__(self, backend: LlamaCppBackend) -> None:
        self._backend = backend
        self.length = 0
        self.context, self.seq = backend._seat()

    def __repr__(self) -> str:
        return f"<LlamaCppCache length={self.length} seq={self.seq}>"

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        if position < self.length:
            self.context.trim(self.seq, position)
            self.length = position

    def __del__(self) -> None:
        backend = getattr(self, "_backend", None)
        if backend is not None and hasattr(self, "context"):
            backend._release(self.context, self.seq)


class LlamaCppBackend(GgufLayers, ComputeBackend):
    """Runs blocks ``lo..hi-1`` of a llama GGUF model in llama.cpp (CPU).

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: llama.cpp threads (default: ``os.cpu_count()``).
        context: KV positions per request (default 2048, at most the model's context).
        seats: sessions per llama.cpp context, the most one ``llama_decode`` batches (default
            ``$STAGERUN_LLAMACPP_SEATS``, else 1). A context's KV cells are allocated when it
            opens, for all its seats: ``seats * context`` positions.

    Why one seat by default: in a shared context every row attends over all its cells, the
    other sessions' too. Measured on 2 threads, layers 10..20 of the default model, 8
    sessions decoding one token each: with 64 positions cached apiece one batch takes 13.9 ms
    where 8 contexts took 18.8 ms one after another; with 512 apiece 25.7 against 25.8 ms,
    and a session decoding alone in such a context takes twice as long (6.6 against 3.2 ms).
    More seats pay off for many short sessions only.
    """

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
        context: int = DEFAULT_CONTEXT,
        seats: int | None = None,
    ) -> None:
        global _backend_ready, _ggml
        c = self._open_layers(model, layers, threads)
        lo, hi = self._lo, self._hi
        self.threads = threads or os.cpu_count() or 1
        self.n_ctx = min(context, c.context_length)
        if seats is None:
            seats = int(os.environ.get(SEATS_ENV) or DEFAULT_SEATS)
        self.seats = seats
        if not 1 <= self.seats <= llama_cpp.llama_max_parallel_sequences():
            raise ValueError(
                f"seats must lie in [1, {llama_cpp.llama_max_parallel_sequences()}], "
                f"not {self.seats}."
            )
        if not _backend_ready:
            llama_cpp.llama_log_set(_quiet, None)  # llama.cpp logs every load and context
            llama_cpp.llama_backend_init()
            _backend_ready = True
        if _ggml is None:
            _ggml = _ggml_base()
        self._ggml = _ggml
        # A stage that is not the last needs no head: its slice keeps a short vocabulary,
        # and the first stage looks its tokens' embeddings up itself.
        self._vocab = None if self.is_last else _headless_vocab(self.model)
        self._embedding: Any = None
        if self._vocab is not None and self.is_first:
            self._embedding = self.model._tensors["token_embd.weight"]
        self.path = (
            Path(self.model.path)
            if (lo, hi) == (0, c.n_layers)
            else slice_model(
                Path(self.model.path),
                lo,
                hi,
                local=[c.is_local(i) for i in range(c.n_layers)],
                vocab=self._vocab,
            )
        )
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        self._out_name = f"l_out-{hi - lo - 1}".encode()
        self._contexts: list[SharedContext] = []

    def __repr__(self) -> str:
        return (
            f"<LlamaCppBackend layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"threads={self.threads} contexts={len(self._contexts)} seats={self.seats}>"
        )

    def __del__(self) -> None:
        # Caches hold the backend, so none is left: free the contexts, then the model.
        for context in getattr(self, "_contexts", ()):
            context.close()
        model, self._model = getattr(self, "_model", None), None
        if model:
            llama_cpp.llama_model_free(model)

    def new_cache(self) -> LlamaCppCache:
        return LlamaCppCache(self)

    def _seat(self) -> tuple[SharedContext, int]:
        """A free sequence of a shared context, opening a new context when all are full."""
        for context in self._contexts:
            seq = context.take()
            if seq is not None:
                return context, seq
        width = self.vocab_size if self.is_last else self.d_model
        run = Run(self._ggml, self._out_name, last=self.is_last, width=width)
        context = SharedContext(
            self._model, seats=self.seats, n_ctx=self.n_ctx, threads=self.threads, run=run
        )
        self._contexts.append(context)
        seq = context.take()
        assert seq is not None
        return context, seq

    def _release(self, context: SharedContext, seq: int) -> None:
        """A cache is gone: free its seat, and its context once no one sits there (one is kept)."""
        context.release(seq)
        if context.idle and len(self._contexts) > 1:
            self._contexts.remove(context)
            context.close()

    def forward(
        self,
        cache: Any,
        position: int,
        *,
        tokens: npt.ArrayLike | Sequence[int] | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Run this stage's layers on new positions (see `stagerun.abc.ComputeBackend`).

        This is `forward_batch` of one item.
        """
        return forward_one(self, ForwardItem(cache, position, tokens, hidden, logits, should_stop))

    def forward_batch(
        self, items: Sequence[ForwardItem]
    ) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
        """Several sessions in one ``llama_decode`` per shared context they sit in.

        Every item is checked before any cache changes, then trimmed to its position. An item
        whose ``should_stop`` fires is left at its position, its result the
        `ComputeCancelled`; the others go on.
        """
        if len({id(item.cache) for item in items}) != len(items):
            raise ValueError("two items of one batched forward share a KV cache.")
        inputs = [self._start(item) for item in items]
        results: list[np.ndarray[Any, Any] | ComputeCancelled | None] = [None] * len(items)
        groups: defaultdict[SharedContext, list[int]] = defaultdict(list)
        for k, item in enumerate(items):
            item.cache.trim(item.position)
            if item.should_stop is not None and item.should_stop():
                results[k] = ComputeCancelled(
                    f"compute at position {item.position} stopped before it started."
                )
            else:
                groups[item.cache.context].append(k)
        for context, ks in groups.items():
            outcome = self._decode(context, [items[k] for k in ks], [inputs[k] for k in ks])
            for k, result in zip(ks, outcome, strict=True):
                results[k] = result
        return [r for r in results if r is not None]

    def _start(self, item: ForwardItem) -> np.ndarray[Any, Any]:
        """An item's input rows, its arguments and cache checked."""
        if item.logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {item.logits!r}.")
        if not isinstance(item.cache, LlamaCppCache) or item.cache._backend is not self:
            raise ValueError("this KV cache was made by another backend.")
        rows = stage_input(
            item.tokens,
            item.hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        if self._embedding is not None:
            rows = self._embed(rows)
        elif not self.is_first and self.config.architecture in SCALES_HIDDEN_INPUT:
            rows = rows * np.float32(1.0 / np.sqrt(self.d_model))  # undone by llama.cpp
        check_positions(
            item.cache.length,
            item.position,
            rows.shape[0],
            self.n_ctx,
            limit_name="this backend's context of",
        )
        return rows

    def _decode(
        self,
        context: SharedContext,
        items: Sequence[ForwardItem],
        inputs: Sequence[np.ndarray[Any, Any]],
    ) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
        """One ``llama_decode`` of the items sitting in ``context``: each one's result."""
        sizes = [x.shape[0] for x in inputs]
        places = [(item.cache.seq, item.position) for item in items]
        stops = [item.should_stop for item in items]
        embeddings = not self.is_first or self._embedding is not None
        done = context.decode(inputs, places, stops, embeddings=embeddings)
        for item, n in zip(items, sizes, strict=True):
            item.cache.length = item.position + n  # so that a trim forgets what was stored
        problem = self._problem(done.status, done.rows, sum(sizes), len(done.stopped), len(items))
        if problem:
            for item in items:
                item.cache.trim(item.position)
            raise RuntimeError(problem)
        results: list[np.ndarray[Any, Any] | ComputeCancelled] = []
        bounds = np.cumsum([0, *sizes])
        for k, item in enumerate(items):
            if k in done.stopped:
                item.cache.trim(item.position)
                results.append(
                    ComputeCancelled(f"compute at position {item.position} stopped between layers.")
                )
                continue
            assert done.rows is not None
            out = done.rows[bounds[k] : bounds[k + 1]]
            out = out[-1:] if self.is_last and item.logits == "last" else out
            results.append(out.copy() if len(items) > 1 else out)
        return results

    def _embed(self, ids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The embeddings of token ``ids`` as llama.cpp's graph would make them from ids."""
        t = self._embedding
        rows = np.asarray(gguf.quants.dequantize(t.data[ids], t.tensor_type), np.float32)
        rows = rows.reshape(len(ids), self.d_model)
        c = self.config
        if c.family.embedding_scale and c.architecture not in SCALES_HIDDEN_INPUT:
            rows *= np.sqrt(np.float32(self.d_model))  # gemma3 scales token input only
        return rows

    @staticmethod
    def _problem(
        status: int, rows: np.ndarray[Any, Any] | None, n: int, stopped: int, items: int
    ) -> str | None:
        """What went wrong in a decode, or None (a graph stopped because all items did is fine)."""
        if status != 0:
            return None if stopped == items else f"llama_decode failed with status {status}"
        if rows is None or rows.shape[0] != n:
            got = None if rows is None else rows.shape
            return f"llama.cpp gave no output for {n} rows (got {got})"
        return None
