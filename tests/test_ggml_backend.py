"""The ggml backend: the pinned library, weights in place, every family, exactness, references.

ggml computes on the file's quantized blocks with activations quantized to 8 bits and a
float16 KV cache (llama.cpp's numerics), so against the float32 numpy reference it is close
(`TOLERANCE`, relative to the largest logit) and agrees on the top token, not bitwise; against
itself it is exact: batched == solo, chunked == whole, split == one stage, 2 threads == 1.
Against llama.cpp on the real models' files, greedy tokens are equal.
"""

from __future__ import annotations

import gc
import logging
import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from _oracle import assert_varied

from stagerun import plugins
from stagerun.abc import ForwardItem
from stagerun.backends import GgmlBackend, NumpyBackend
from stagerun.backends._ggml import _backend, _cores, _graph, _lib
from stagerun.backends._ggml._cores import HostCores
from stagerun.model import FAMILIES, ModelFile, open_model
from stagerun.testing import check_backend, check_family, write_tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_families import CASES, IDS, _options
from test_gemma3 import LLAMA_CPP_TIE, assert_agrees, greedy

TOLERANCE = 1e-2  # relative to the largest logit: Q8 activations, float16 keys and values


@pytest.fixture(scope="module", params=list(CASES))
def case_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(f"ggml-{request.param}")
    return request.param, open_model(write_tiny_model(folder / "m.gguf", **_options(request.param)))


# -- the library --------------------------------------------------------------------------------


def test_the_pinned_ggml_loads_and_its_tensor_struct_is_the_declared_one() -> None:
    ffi, lib = _lib.load()
    assert ffi.string(lib.ggml_version()).decode() == _lib.GGML_VERSION
    params = ffi.new("struct ggml_init_params *", {"mem_size": 1 << 20, "no_alloc": False})
    ctx = lib.ggml_init(params[0])
    try:
        t = lib.ggml_new_tensor_2d(ctx, 3, 64, 5)  # Q4_1: 2 blocks of 20 bytes a row
        assert (t.type, list(t.ne), t.nb[1], t.nb[2]) == (3, [64, 5, 1, 1], 40, 200)
        assert lib.ggml_nbytes(t) == 200 and t.data != ffi.NULL
        view = lib.ggml_view_2d(ctx, t, 64, 2, 40, 80)
        assert view.view_src == t and view.view_offs == 80
    finally:
        lib.ggml_free(ctx)


def test_a_library_of_another_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lib, "GGML_VERSION", "0.0.1")
    with pytest.raises(_lib.GgmlUnavailableError, match=r"holds ggml 0\.20\.2"):
        _lib.load.__wrapped__()
    monkeypatch.undo()
    monkeypatch.setattr(_lib, "TENSOR_SIZE", 344)
    with pytest.raises(_lib.GgmlUnavailableError, match="not the declared one"):
        _lib.load.__wrapped__()


def test_a_cpu_without_avx2_is_refused_before_anything_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_lib, "_cpu_flags", lambda: {"sse2", "fma", "f16c"})
    with pytest.raises(_lib.GgmlUnavailableError, match="lacks AVX2"):
        _lib.load.__wrapped__()


def test_auto_means_ggml_here_and_numpy_where_ggml_cannot_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert plugins.resolve_backend("auto") == "ggml"
    assert plugins.backend("auto") is GgmlBackend
    monkeypatch.setattr(GgmlBackend, "unavailable", staticmethod(lambda: "no AVX2 here"))
    monkeypatch.setattr(plugins, "_said_why", set())
    with caplog.at_level(logging.WARNING, logger="stagerun.plugins"):
        assert plugins.backend("auto") is NumpyBackend
        assert plugins.resolve_backend("auto") == "numpy"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["the ggml backend is not available (no AVX2 here); computing with numpy"]
    with pytest.raises(plugins.PluginError, match="ggml backend cannot run here: no AVX2 here"):
        plugins.backend("ggml")


def test_weights_are_the_file_s_own_bytes_not_copies(smollm2: ModelFile) -> None:
    backend = GgmlBackend(smollm2, (0, 10))
    ffi = backend._ffi
    start = smollm2.mapping.ctypes.data
    for name, tensor in backend._tensors.items():
        stored = smollm2.stored(name)
        assert int(ffi.cast("uintptr_t", tensor.data)) == start + stored.offset, name
        assert tensor.type == stored.qtype
    assert backend._tensors["blk.0.attn_q.weight"].type == 3  # Q4_1, as stored
    assert "token_embd.weight" in backend._tensors and "output_norm.weight" not in backend._tensors


# -- every family, against the reference and itself -----------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_built_in_family_passes_the_family_suite_on_ggml(
    family: str, tmp_path: pathlib.Path
) -> None:
    check_family(FAMILIES[family], directory=tmp_path, backend=GgmlBackend)


def test_every_variant_passes_the_backend_suite_on_ggml(case_model: Any) -> None:
    _, model = case_model
    check_backend(GgmlBackend, model)


def test_ggml_is_close_to_the_float32_reference_on_every_variant(case_model: Any) -> None:
    case, model = case_model
    numpy, ggml = NumpyBackend(model), GgmlBackend(model)
    want = numpy.forward(numpy.new_cache(), 0, tokens=IDS, logits="all")
    got = ggml.forward(ggml.new_cache(), 0, tokens=IDS, logits="all")
    assert_varied(list(want.argmax(axis=1)))
    error = float(np.abs(got - want).max() / np.abs(want).max())
    assert error < TOLERANCE, f"{case}: relative difference {error:.3g}"
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.95, case


def test_a_trait_run_wrong_is_far_from_the_reference(tmp_path: pathlib.Path) -> None:
    """The tolerance can fail: qwen3's halves rotated as llama's pairs are far off."""
    model = open_model(write_tiny_model(tmp_path / "m.gguf", family="qwen3"))
    numpy, ggml = NumpyBackend(model), GgmlBackend(model)
    ggml._ops._rope_mode = _lib.ROPE_NORMAL
    want = numpy.forward(numpy.new_cache(), 0, tokens=IDS, logits="all")
    got = ggml.forward(ggml.new_cache(), 0, tokens=IDS, logits="all")
    assert float(np.abs(got - want).max() / np.abs(want).max()) > 5 * TOLERANCE


# -- exactness on the real model ------------------------------------------------------------------


def _chunked(backend: GgmlBackend, ids: list[int], chunks: list[int]) -> np.ndarray:
    cache, outs, at = backend.new_cache(), [], 0
    for n in chunks:
        outs.append(backend.forward(cache, at, tokens=ids[at : at + n]))
        at += n
    return np.concatenate(outs)


def test_a_prompt_computes_the_same_in_any_chunks_and_would_not_without_key_blocks(
    smollm2: ModelFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The softmax attention's sums run over whole key blocks, so a chunk's rows do not depend
    on how many keys it reached."""
    backend = GgmlBackend(smollm2, (0, 4), flash_attention=False)
    ids = list(np.random.default_rng(1).integers(0, smollm2.config.vocab_size, 150))
    whole = _chunked(backend, ids, [150])
    assert np.array_equal(_chunked(backend, ids, [7, 60, 83]), whole)
    # attend to exactly the keys a chunk reaches (no blocks, and no room for a kept graph)
    monkeypatch.setattr(_graph, "KEY_BLOCK", 1)
    monkeypatch.setattr(_backend, "REUSE_ROOM", 0)
    backend = GgmlBackend(smollm2, (0, 4), flash_attention=False)  # no graphs kept from before
    assert not np.array_equal(_chunked(backend, ids, [7, 60, 83]), whole)


def test_flash_attention_computes_the_same_in_any_chunks_and_would_not_with_its_tiles(
    smollm2: ModelFile,
) -> None:
    """Flash attention skips masked keys, so the keys a chunk reaches do not matter (KEY_BLOCK
    1 changes nothing); ggml's tiled kernel for 64 rows and more sums otherwise than its
    row kernel, so the backend asks for the row kernel everywhere (``use_ref``)."""
    backend = GgmlBackend(smollm2, (0, 4))
    ids = list(np.random.default_rng(1).integers(0, smollm2.config.vocab_size, 150))
    whole = _chunked(backend, ids, [150])
    assert np.array_equal(_chunked(backend, ids, [7, 60, 83]), whole)
    assert np.array_equal(_chunked(backend, ids, [1] * 10 + [140]), whole)
    backend._lib.ggml_backend_cpu_set_use_ref(backend._cpu, False)  # the tiles for 64+ rows
    assert not np.array_equal(_chunked(backend, ids, [7, 60, 83]), _chunked(backend, ids, [150]))


def test_a_decode_step_over_many_keys_is_the_same_on_one_thread_and_two(
    smollm2: ModelFile,
) -> None:
    """ggml's flash attention splits one row's keys among the threads from 512 keys on, and
    sums the parts in the thread count's order; the row kernel the backend asks for does not."""
    ids = list(np.random.default_rng(2).integers(0, smollm2.config.vocab_size, 700))

    def step(threads: int, row_kernel: bool = True) -> np.ndarray:
        backend = GgmlBackend(smollm2, (0, 3), threads=threads)
        backend._lib.ggml_backend_cpu_set_use_ref(backend._cpu, row_kernel)
        backend._cores.close()  # compute on `threads` whatever else runs on the host
        cache = backend.new_cache()
        backend.forward(cache, 0, tokens=ids[:-1])
        return backend.forward(cache, len(ids) - 1, tokens=ids[-1:])

    assert np.array_equal(step(1), step(2))
    assert not np.array_equal(step(1, row_kernel=False), step(2, row_kernel=False))


def _steps(backend: GgmlBackend, inputs: np.ndarray, prompt: int) -> np.ndarray:
    """Prefill ``prompt`` rows of ``inputs`` (token ids, or hidden states on a later stage),
    then feed the rest one at a time: every row's output (hidden states, or logits on the
    last stage)."""
    cache = backend.new_cache()
    field = "tokens" if inputs.ndim == 1 else "hidden"
    outs = [backend.forward(cache, 0, logits="all", **{field: inputs[:prompt]})]
    for at in range(prompt, len(inputs)):
        outs.append(backend.forward(cache, at, logits="all", **{field: inputs[at : at + 1]}))
    return np.concatenate(outs)


@pytest.mark.parametrize("layers", [(0, 3), (12, 15), (27, 30)])
def test_decode_steps_reuse_a_kept_graph_and_compute_what_one_whole_forward_does(
    smollm2: ModelFile, monkeypatch: pytest.MonkeyPatch, layers: tuple[int, int]
) -> None:
    """190 decode steps after a 230-row prompt build 3 graphs, and each step's output is
    bitwise the row the same 420 positions give in one forward (chunk invariance; the whole
    forward is too big to keep, so it is built apart)."""
    monkeypatch.setattr(_backend, "REUSE_ROWS", 64)
    monkeypatch.setattr(_backend, "REUSE_ROOM", 64)
    rng = np.random.default_rng(7)
    if layers[0]:  # a later stage: hidden states in, hidden states (or logits) out
        inputs = rng.standard_normal((420, smollm2.config.d_model)).astype(np.float32)
    else:  # the first stage: token ids in (the embedding in the graph), hidden states out
        inputs = rng.integers(0, smollm2.config.vocab_size, 420)
    builds: list[int] = []
    build = GgmlBackend._build

    def counted(self: GgmlBackend, *args: Any) -> Any:
        builds.append(len(args[0]))
        return build(self, *args)

    monkeypatch.setattr(GgmlBackend, "_build", counted)
    backend = GgmlBackend(smollm2, layers, threads=1)
    steps = _steps(backend, inputs, 230)[230:]
    # the prompt's graph, then one at step 230 (keys to 320) and one at 320 (keys run out;
    # to 448): no others
    assert len(builds) == 3, f"{len(builds) - 1} graphs built for 190 steps"
    assert backend._graphs, "the last step's graph is kept"
    field = "tokens" if inputs.ndim == 1 else "hidden"
    whole = GgmlBackend(smollm2, layers, threads=1)
    expected = whole.forward(whole.new_cache(), 0, logits="all", **{field: inputs})[230:]
    assert len(steps) == len(expected) == 190
    assert len({row.tobytes() for row in expected}) == len(expected)  # every step its own
    assert np.array_equal(steps, expected)


def test_a_kept_graph_lives_in_its_own_memory_while_bigger_graphs_come_and_go(
    smollm2: ModelFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefills of growing size between one session's decode steps make the shared compute
    buffer grow (freed and allocated again): the kept graph of the decode steps must not have
    been laid out in it (once it was, and stage 0 crashed with a corrupted heap)."""
    monkeypatch.setattr(_backend, "REUSE_ROWS", 64)
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, smollm2.config.vocab_size, 112)  # a prompt of 80 is not kept
    alone = _steps(GgmlBackend(smollm2, (0, 3), threads=1), tokens, 80)[80:]
    backend = GgmlBackend(smollm2, (0, 3), threads=1)
    cache = backend.new_cache()
    backend.forward(cache, 0, tokens=tokens[:80])
    steps = []
    for at in range(80, len(tokens)):
        steps.append(backend.forward(cache, at, logits="all", tokens=tokens[at : at + 1]))
        if at % 8 == 0:  # a bigger prompt of another session each time: never kept
            prompt = rng.integers(0, smollm2.config.vocab_size, 10 * at)
            backend.forward(backend.new_cache(), 0, tokens=prompt)
    assert len(backend._graphs) == 1, "the decode steps' graph is kept throughout"
    assert len({row.tobytes() for row in alone}) == len(alone) == 32  # every step its own
    assert np.array_equal(np.concatenate(steps), alone)


def test_a_kept_graph_does_not_keep_its_sessions_caches_and_serves_their_slot_again(
    smollm2: ModelFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_backend, "REUSE_ROWS", 64)
    import weakref

    backend = GgmlBackend(smollm2, (0, 2))
    cache = backend.new_cache()
    first = backend.forward(cache, 0, tokens=[1, 2, 3])
    assert backend._graphs, "a three-row forward keeps its graph"
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None
    # a new cache takes the slot given back, and the kept graph computes its rows
    again = backend.new_cache()
    assert again.slot == 0
    built = backend._build
    monkeypatch.setattr(backend, "_build", lambda *a: pytest.fail("a graph was built"))
    second = backend.forward(again, 0, tokens=[3, 2, 1])
    monkeypatch.setattr(backend, "_build", built)
    alone = GgmlBackend(smollm2, (0, 2))
    assert np.array_equal(second, alone.forward(alone.new_cache(), 0, tokens=[3, 2, 1]))
    assert not np.array_equal(first, second)


def test_sessions_batched_compute_what_each_computes_alone_on_both_stages(
    smollm2: ModelFile,
) -> None:
    first, last = GgmlBackend(smollm2, (0, 12), threads=2), GgmlBackend(smollm2, (12, 30))
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, smollm2.config.vocab_size, n)) for n in (5, 70, 1, 33)]
    alone = []
    for p in prompts:
        hidden = first.forward(first.new_cache(), 0, tokens=p)
        alone.append(last.forward(last.new_cache(), 0, hidden=hidden, logits="all"))
    caches = [(first.new_cache(), last.new_cache()) for _ in prompts]
    hidden = first.forward_batch(
        [ForwardItem(c, 0, tokens=p) for (c, _), p in zip(caches, prompts, strict=True)]
    )
    together = last.forward_batch(
        [
            ForwardItem(c, 0, hidden=h, logits="all")
            for (_, c), h in zip(caches, hidden, strict=True)
        ]
    )
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b)
    assert not np.array_equal(alone[0][-1], alone[3][-1])


def test_two_threads_compute_bitwise_what_one_does(smollm2: ModelFile) -> None:
    ids = list(range(100, 140))
    outs = []
    for threads in (1, 2):
        backend = GgmlBackend(smollm2, (0, 30), threads=threads)
        outs.append(backend.forward(backend.new_cache(), 0, tokens=ids, logits="all"))
    assert_varied(list(outs[0].argmax(axis=1)))
    assert np.array_equal(outs[0], outs[1])


def test_a_backend_s_compute_threads_go_with_it(smollm2: ModelFile) -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    backend = GgmlBackend(smollm2, (0, 2), threads=3)
    backend.forward(backend.new_cache(), 0, tokens=[1, 2, 3])
    assert threads() == before + 2  # its pool: two threads beside the one that computes
    del backend
    gc.collect()
    assert threads() == before


def test_a_long_prefill_is_cut_into_graphs_and_polled_between_them(smollm2: ModelFile) -> None:
    backend = GgmlBackend(smollm2, (0, 30))
    polls = 0

    def count() -> bool:
        nonlocal polls
        polls += 1
        return False

    backend.forward(backend.new_cache(), 0, tokens=list(range(1, 2)), should_stop=count)
    assert polls == 1  # a decode step is one graph
    polls = 0
    backend.forward(backend.new_cache(), 0, tokens=list(range(1, 512)), should_stop=count)
    assert polls >= 511 * 30 // 2048


# -- against llama.cpp, on the real models' files -------------------------------------------------

PROMPTS = [
    "Once upon a time, in a small village, there lived a girl named",
    "The three primary colors are",
    "def fibonacci(n):",
]


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
@pytest.mark.parametrize("flash", [True, False], ids=["flash-attention", "softmax"])
def test_greedy_tokens_equal_llama_cpp_s_up_to_near_ties_on_the_real_models(
    name: str, flash: bool
) -> None:
    """llama.cpp (built here with AVX-512) sums some products in another order than this
    ggml (AVX2), so an ulp apart, and once the 8-bit activations round the other way the
    logits differ by ~1 (as they do from numpy's): greedy tokens are equal up to where our
    top two are within `LLAMA_CPP_TIE`; every divergence is printed with its margin. Each
    attention against llama.cpp's same one (``-fa on`` / ``off``)."""
    from stagerun_llamacpp import LlamaCppBackend

    model = open_model(name)
    ours = GgmlBackend(model, threads=2, flash_attention=flash)
    # one seat: llama.cpp's default, flash attention on; two: off (the plugin's choice)
    theirs = LlamaCppBackend(model, threads=2, seats=1 if flash else 2)
    try:
        equal = 0
        for prompt in PROMPTS:
            ids = model.tokenizer.encode(prompt)
            got, margins = greedy(ours, ids)
            assert_varied(got)
            want, _ = greedy(theirs, ids)
            assert_agrees(got, margins, want, f"{name}, {prompt!r}", tie=LLAMA_CPP_TIE)
            equal += got == want
        # flash attention sums the values in float16 (both ggmls do): logits move by more,
        # and on these three prompts every SmolLM2 run diverges somewhere, at a near-tie
        assert equal >= 1 or flash, "no prompt gave llama.cpp's tokens"
    finally:
        del theirs
        gc.collect()


def test_interrupt_stops_a_graph_between_its_nodes(smollm2: ModelFile) -> None:
    """`interrupt` aborts the running graph at its next node: the item is cancelled, its cache
    left at its position, and the backend computes on exactly as before."""
    import threading
    import time

    from stagerun import ComputeCancelled

    tokens = list(np.random.default_rng(3).integers(0, smollm2.config.vocab_size, 768))
    backend = GgmlBackend(smollm2, (0, 10))
    cache = backend.new_cache()
    timer = threading.Timer(0.15, backend.interrupt)
    started = time.perf_counter()
    timer.start()
    (out,) = backend.forward_batch(
        [ForwardItem(cache, 0, tokens=tokens, should_stop=lambda: False)]
    )
    stopped_after = time.perf_counter() - started
    timer.join()
    assert isinstance(out, ComputeCancelled) and cache.length == 0
    whole_started = time.perf_counter()
    again = backend.forward(cache, 0, tokens=tokens)
    whole = time.perf_counter() - whole_started
    assert stopped_after < 0.15 + whole / 3, (stopped_after, whole)  # not the whole prefill
    fresh = GgmlBackend(smollm2, (0, 10))
    assert np.array_equal(again, fresh.forward(fresh.new_cache(), 0, tokens=tokens))


def test_a_quick_graph_after_the_host_idled_runs_on_one_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waking a sleeping core cost 10 ms on these VMs: a kept graph that one thread computes
    in under `ONE_THREAD_S`, coming `WAKE_IDLE_S` after the host's latest graph, takes one
    thread; one right behind a graph of its own or of another stage of the host, a new graph,
    a longer one or a big one (a prefill) takes the stage's threads."""
    model = open_model(write_tiny_model(tmp_path / "tiny.gguf", n_layers=2))
    backend = GgmlBackend(model, threads=2)
    backend._cores = HostCores(2, str(tmp_path / "cores"))  # this test's host alone
    other_stage = HostCores(2, str(tmp_path / "cores"))
    asked: list[int] = []
    taken = backend._cores.taken

    def recording(want: int) -> Any:
        asked.append(want)
        return taken(want)

    monkeypatch.setattr(backend._cores, "taken", recording)
    clock = [100.0]
    monkeypatch.setattr(_cores.time, "monotonic", lambda: clock[0])
    cache = backend.new_cache()

    def step(position: int, tokens: int, *, idle: float = 1.5) -> None:
        clock[0] += _backend.WAKE_IDLE_S * idle
        ids = np.arange(1, tokens + 1, dtype=np.int64)
        backend.forward_batch([ForwardItem(cache, position, tokens=ids, logits="last")])

    step(0, 1)  # after an idle spell, but the first graph: how long it takes is not known
    step(1, 1, idle=0.5)  # right behind the previous one
    step(2, 1)  # after an idle spell
    with other_stage.taken(1):  # another stage of the host computes, and ends
        pass
    step(3, 1, idle=0.5)  # this stage idled, the host did not
    (kept,) = backend._graphs.values()
    assert kept.thread_seconds is not None and kept.thread_seconds < _backend.ONE_THREAD_S
    kept.thread_seconds = _backend.ONE_THREAD_S * 2  # as if it took one thread 20 ms
    step(4, 1)  # after an idle spell, but long enough to be worth two threads
    step(5, _backend.REUSE_ROWS + 1)  # a prefill chunk, after an idle spell
    cache = backend.new_cache()  # another request: a new graph, judged by the latest kept
    step(0, 1)
    assert asked == [2, 2, 1, 2, 2, 2, 1]


LOCK_HELD = """
from stagerun.backends._ggml._lib import load
ffi, lib = load()
names = dir(lib)
with ffi._lock:  # what cffi holds while it binds a name, when a collection can run a finalizer
    for name in names:
        getattr(lib, name)  # what that finalizer does: free through a name, maybe a new one
print(len(names))
"""


def test_every_ggml_name_is_bound_at_load_so_a_finalizer_never_waits_for_cffi() -> None:
    # A fresh process: this one's names were bound long ago by the tests before. Unbound, the
    # first name reached blocks on the lock its own thread holds (seen: a stage's compute thread
    # hung in a graph's close, with a KV cache's finalizer run by a collection below it).
    done = subprocess.run(
        [sys.executable, "-c", LOCK_HELD], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 40  # every function the backend calls, and its enum values
