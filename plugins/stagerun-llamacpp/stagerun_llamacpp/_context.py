"""A llama.cpp context shared by several sessions: each session's KV cache is a sequence id.

Theory of operation: llama.cpp batches sessions through sequence ids. One context holds up to
``seats`` sequences; a batch (`llama_batch`) gives every row its sequence and position, and
llama.cpp runs the rows of all sequences through each block together, attending per sequence.

* The KV cache is unified (``kv_unified``): the sequences share ``seats * n_ctx`` cells, so
  each can fill its ``n_ctx`` positions. A unified cache splits a batch into ubatches in batch
  order (``split_simple``), so the hidden states captured from each ubatch, one after
  another, line up with the batch's rows. (A cache per sequence, ``kv_unified=False``, splits
  with ``split_equal``: a ubatch takes as many rows of each sequence, of consecutive sequence
  ids only, in an order of its own; mixed batches became many small ubatches.)
* The price of the unified cache: every row's attention runs over all the context's cells,
  other sessions' included (masked). See `LlamaCppBackend` for what that costs.
* The eval callback (`Run.observe`) copies the last block's output ``l_out-{n-1}`` out of
  the graph (a non-last stage's result) and polls each item's ``should_stop`` after every
  other block's output. An item that stops is marked; llama.cpp cannot drop its rows from a
  running graph, so they are computed to the end and then thrown away. When every item of
  the decode has stopped, the callback stops the graph.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import llama_cpp
import numpy as np

__all__ = ["Decoded", "Run", "SharedContext"]


class Run:
    """What the eval callback sees of the decode in progress: whom to poll, what to capture.

    Args:
        ggml: ggml's base library (`ggml_get_name`, `ggml_nbytes`, `ggml_backend_tensor_get`).
        out_name: the last block's output tensor, ``l_out-{n-1}``.
        last: the stage is the model's last: its output is logits, nothing is captured.
        width: an output row's width, the vocabulary on the last stage, else ``d_model``.
    """

    def __init__(self, ggml: ctypes.CDLL, out_name: bytes, *, last: bool, width: int) -> None:
        self._ggml, self._out_name = ggml, out_name
        self.last, self.width = last, width
        self.captured: list[np.ndarray[Any, Any]] = []
        self.stops: list[Callable[[], bool] | None] = []
        self.stopped: set[int] = set()

    def begin(self, stops: Sequence[Callable[[], bool] | None]) -> None:
        self.captured, self.stops, self.stopped = [], list(stops), set()

    def end(self) -> None:
        self.stops = []  # the callables may hold a session's state: do not keep them

    def observe(self, tensor: int, ask: bool, _user: Any) -> bool:
        """ask=True: is this tensor wanted? ask=False: it is computed; False stops the graph."""
        name = self._ggml.ggml_get_name(tensor)
        wanted = name == self._out_name and not self.last
        between = name.startswith(b"l_out-") and name != self._out_name
        if ask:
            # each observed tensor splits the graph: ask for the others only when polling
            return wanted or (between and any(self.stops))
        if wanted:
            size = self._ggml.ggml_nbytes(tensor)
            out = np.empty(size // 4, np.float32)
            self._ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, size)
            self.captured.append(out.reshape(-1, self.width))
        elif between:
            return self._poll()
        return True

    def _poll(self) -> bool:
        """Poll every item that may still stop; False once all of them have stopped."""
        for k, stop in enumerate(self.stops):
            if stop is not None and k not in self.stopped and stop():
                self.stopped.add(k)
        return len(self.stopped) < len(self.stops)


@attrs.frozen(eq=False)
class Decoded:
    """One ``llama_decode``'s outcome: its status, the items that stopped, its output rows.

    ``rows`` are in batch order, None when the decode failed or gave no output.
    """

    status: int
    stopped: frozenset[int]
    rows: np.ndarray[Any, Any] | None


class SharedContext:
    """One llama.cpp context whose sequences are the KV caches of up to ``seats`` sessions.

    Args:
        model: the loaded ``llama_model`` pointer (its owner keeps it alive longer).
        seats: sequences, each a session's cache.
        n_ctx: positions per sequence.
        threads: llama.cpp's threads.
        run: the eval callback's state (see `Run`), one per context.
    """

    def __init__(self, model: Any, *, seats: int, n_ctx: int, threads: int, run: Run) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx * seats
        params.n_ubatch = min(512, n_ctx)
        params.n_seq_max = seats
        params.kv_unified = True
        if seats > 1:
            # Flash attention accumulates in float16 in the order of the cache's cells, which
            # a shared cache lays out by its history: a session's logits moved by 1e-3 with
            # the other sessions beside it. The plain path sums in float32.
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = params.n_threads_batch = threads
        self._run = run
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(run.observe)  # kept alive
        params.cb_eval = self._callback
        params.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context")
        self._free = list(range(seats - 1, -1, -1))
        self.seats = seats

    def __repr__(self) -> str:
        return f"<SharedContext seats={self.seats} taken={self.seats - len(self._free)}>"

    @property
    def idle(self) -> bool:
        """No session sits in the context."""
        return len(self._free) == self.seats

    def take(self) -> int | None:
        """A free sequence id, or None when every seat is taken."""
        return self._free.pop() if self._free else None

    def release(self, seq: int) -> None:
        """Give a sequence back, its positions forgotten."""
        if self.ctx:
            self.trim(seq, 0)
            self._free.append(seq)

    def trim(self, seq: int, position: int) -> None:
        """Forget sequence ``seq``'s positions at and after ``position``."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), seq, position, -1)

    def decode(
        self,
        rows: Sequence[np.ndarray[Any, Any]],
        places: Sequence[tuple[int, int]],
        stops: Sequence[Callable[[], bool] | None],
        *,
        embeddings: bool,
    ) -> Decoded:
        """Run one batch: item ``k`` is ``rows[k]`` (token ids, or hidden states when
        ``embeddings``) at ``places[k] = (sequence, first position)``, polling ``stops[k]``.

        Returns the status, the items that stopped, and the output rows in batch order: the
        logits, or the captured hidden states when the context is not the model's last stage.
        """
        stacked = np.ascontiguousarray(np.concatenate(rows))
        n = stacked.shape[0]
        batch = llama_cpp.llama_batch_init(n, stacked.shape[1] if embeddings else 0, 1)
        self._run.begin(stops)
        try:
            batch.n_tokens = n
            if embeddings:
                ctypes.memmove(batch.embd, stacked.ctypes.data, stacked.nbytes)
            else:
                for i, token in enumerate(stacked):
                    batch.token[i] = int(token)
            self._place(batch, [r.shape[0] for r in rows], places)
            status = llama_cpp.llama_decode(self.ctx, batch)
            stopped = frozenset(self._run.stopped)
            return Decoded(status, stopped, self._output(n) if status == 0 else None)
        finally:
            self._run.end()
            llama_cpp.llama_batch_free(batch)

    @staticmethod
    def _place(batch: Any, sizes: Sequence[int], places: Sequence[tuple[int, int]]) -> None:
        """Every row's sequence and position; every row asks for its output."""
        i = 0
        for size, (seq, position) in zip(sizes, places, strict=True):
            for t in range(size):
                batch.pos[i] = position + t
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1  # every row: or llama.cpp prunes the last block's rows
                i += 1

    def _output(self, n: int) -> np.ndarray[Any, Any] | None:
        """The decode's ``n`` output rows: a copy of the logits, or the captured hidden states."""
        if not self._run.last:
            return np.concatenate(self._run.captured) if self._run.captured else None
        pointer = llama_cpp.llama_get_logits(self.ctx)
        if not pointer:
            return None
        return np.ctypeslib.as_array(pointer, shape=(n, self._run.width)).copy()

    def close(self) -> None:
        """Free the context (its owner calls this before freeing the model)."""
        ctx, self.ctx = self.ctx, None
        if ctx:
            llama_cpp.llama_free(ctx)
