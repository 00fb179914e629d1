"""One stage's layers in llama.cpp, through llama-cpp-python's low-level API.

Theory of operation: the stage loads a GGUF slice holding only its blocks (`_slice`), so
llama.cpp computes exactly the stage's layer range in its own (quantized) kernels:

* **input**: the first stage passes token ids; the others pass the previous stage's hidden
  states as the batch's embedding input (``llama_batch_init(T, n_embd, 1)``, rows copied into
  ``batch.embd``), which llama.cpp feeds to block 0 in place of the token embeddings;
* **output**: the last stage reads logits; the others read the output of their last block,
  ``l_out-{n-1}``, from the graph through the eval callback, which copies the tensor out with
  ``ggml_backend_tensor_get``. Every row must request an output, or llama.cpp prunes the last
  block to the rows whose logits were asked for;
* **KV cache**: one llama.cpp context per request (the cache object), trimmed with
  ``llama_memory_seq_rm``; positions are absolute, like every stagerun backend.

``should_stop`` is polled before the graph and, through the same eval callback, after every
block's output ``l_out-i`` (only while a ``should_stop`` is given: each observed tensor splits
the graph). When it returns True the callback stops the graph, the cache is trimmed back to the
position and `ComputeCancelled` is raised. Blocking code, called from one worker thread at a
time.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import llama_cpp
import numpy as np
import numpy.typing as npt

from stagerun import ComputeCancelled
from stagerun.abc import ComputeBackend
from stagerun.backends import GgufLayers, check_positions, stage_input
from stagerun.model import ModelFile

from ._slice import slice_model

__all__ = ["LlamaCppBackend", "LlamaCppCache"]

DEFAULT_CONTEXT = 2048
_backend_ready = False


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
    """One request's llama.cpp context (its KV cache) on one stage."""

    def __init__(self, backend: LlamaCppBackend) -> None:
        self._backend = backend
        self.length = 0
        self.ctx = backend._new_context(self)
        self.captured: np.ndarray[Any, Any] | None = None
        self.stop: Callable[[], bool] | None = None
        self.stopped = False

    def __repr__(self) -> str:
        return f"<LlamaCppCache length={self.length}>"

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        if position < self.length:
            memory = llama_cpp.llama_get_memory(self.ctx)
            llama_cpp.llama_memory_seq_rm(memory, 0, position, -1)
            self.length = position

    def __del__(self) -> None:
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            llama_cpp.llama_free(ctx)


class LlamaCppBackend(GgufLayers, ComputeBackend):
    """Runs blocks ``lo..hi-1`` of a llama GGUF model in llama.cpp (CPU).

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: llama.cpp threads (default: ``os.cpu_count()``).
        context: KV positions per request (default 2048, at most the model's context).
    """

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
        context: int = DEFAULT_CONTEXT,
    ) -> None:
        global _backend_ready, _ggml
        c = self._open_layers(model, layers, threads)
        lo, hi = self._lo, self._hi
        self.threads = threads or os.cpu_count() or 1
        self.n_ctx = min(context, c.context_length)
        if not _backend_ready:
            llama_cpp.llama_log_set(_quiet, None)  # llama.cpp logs every load and context
            llama_cpp.llama_backend_init()
            _backend_ready = True
        if _ggml is None:
            _ggml = _ggml_base()
        self._ggml = _ggml
        self.path = (
            Path(self.model.path)
            if (lo, hi) == (0, c.n_layers)
            else slice_model(Path(self.model.path), lo, hi)
        )
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        self._out_name = f"l_out-{hi - lo - 1}".encode()
        self._callback_ref: Any = None

    def __repr__(self) -> str:
        return (
            f"<LlamaCppBackend layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"threads={self.threads}>"
        )

    def __del__(self) -> None:
        model, self._model = getattr(self, "_model", None), None
        if model:
            llama_cpp.llama_model_free(model)

    def new_cache(self) -> LlamaCppCache:
        return LlamaCppCache(self)

    def _new_context(self, cache: LlamaCppCache) -> Any:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_ctx
        params.n_ubatch = min(512, self.n_ctx)
        params.n_seq_max = 1
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        wanted = self._out_name
        last = self.is_last
        ggml = self._ggml
        d_model = self.d_model

        def observe(tensor: int, ask: bool, _user: Any) -> bool:
            # ask=True: do we want this tensor? ask=False: it is computed; False stops the graph.
            name = ggml.ggml_get_name(tensor)
            if ask:
                return bool(
                    (name == wanted and not last)
                    or (cache.stop is not None and name.startswith(b"l_out-"))
                )
            if name == wanted and not last:
                size = ggml.ggml_nbytes(tensor)
                out = np.empty(size // 4, np.float32)
                ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, size)
                cache.captured = out.reshape(-1, d_model)
            elif (
                cache.stop is not None
                and name != wanted
                and name.startswith(b"l_out-")
                and cache.stop()  # between two layers
            ):
                cache.stopped = True
                return False
            return True

        callback = llama_cpp.ggml_backend_sched_eval_callback(observe)
        params.cb_eval = callback
        params.cb_eval_user_data = None
        cache._callback = callback  # type: ignore[attr-defined]  # keep it alive
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            raise ValueError("llama.cpp could not create a context")
        return ctx

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
        """Run this stage's layers on new positions (see `stagerun.abc.ComputeBackend`)."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {logits!r}.")
        if not isinstance(cache, LlamaCppCache) or cache._backend is not self:
            raise ValueError("this KV cache was made by another backend.")
        rows = stage_input(
            tokens,
            hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        n = rows.shape[0]
        check_positions(
            cache.length, position, n, self.n_ctx, limit_name="this backend's context of"
        )
        cache.trim(position)
        if should_stop is not None and should_stop():
            raise ComputeCancelled(f"compute at position {position} stopped before it started.")
        cache.stop, cache.stopped = should_stop, False
        batch = llama_cpp.llama_batch_init(n, 0 if self.is_first else self.d_model, 1)
        try:
            batch.n_tokens = n
            if self.is_first:
                for i, token in enumerate(rows):
                    batch.token[i] = int(token)
            else:
                ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
            for i in range(n):
                batch.pos[i] = position + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1  # every row: or llama.cpp prunes the last block's rows
            cache.captured = None
            status = llama_cpp.llama_decode(cache.ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
            cache.stop = None
        if cache.stopped:
            cache.length = position + n
            cache.trim(position)
            raise ComputeCancelled(f"compute at position {position} stopped between layers.")
        if status != 0:
            cache.trim(position)
            raise RuntimeError(f"llama_decode failed with status {status}")
        cache.length = position + n
        if self.is_last:
            pointer = llama_cpp.llama_get_logits(cache.ctx)
            out = np.ctypeslib.as_array(pointer, shape=(n, self.vocab_size)).copy()
            return out if logits == "all" else out[-1:]
        if cache.captured is None or cache.captured.shape[0] != n:
            got = None if cache.captured is None else cache.captured.shape
            raise RuntimeError(f"llama.cpp gave no hidden states for {n} rows (got {got})")
        return cache.captured
