"""The llama.cpp backend: layer slices, conformance, agreement with numpy, mixed pipelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import stagerun_llamacpp
from stagerun_llamacpp import slice_model

from stagerun import ComputeCancelled, open_pipeline, plugins
from stagerun.abc import ForwardItem
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile, open_model
from stagerun.testing import check_backend, write_tiny_model

pytestmark = pytest.mark.llama_cpp

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a lighthouse by the sea, there lived",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelFile:
    return open_model(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="module")
def smollm2() -> ModelFile:
    return open_model("smollm2")


@pytest.fixture(autouse=True)
def slice_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGERUN_LLAMACPP_CACHE", str(tmp_path_factory.getbasetemp() / "slices"))


def test_registered() -> None:
    plugins.refresh()
    assert plugins.backend("llamacpp") is stagerun_llamacpp.LlamaCppBackend


def test_a_slice_holds_only_its_blocks_and_is_cached(tiny: ModelFile, tmp_path: Path) -> None:
    first = slice_model(Path(tiny.path), 1, 3, directory=tmp_path)
    sliced = open_model(first)
    assert sliced.config.n_layers == 2
    assert sliced.config.vocab_size == tiny.config.vocab_size
    mtime = first.stat().st_mtime_ns
    assert slice_model(Path(tiny.path), 1, 3, directory=tmp_path) == first
    assert first.stat().st_mtime_ns == mtime  # not written again
    # Block 1 of the source is block 0 of the slice.
    a = tiny.load_weights(1, 2, embeddings=False, head=False).layers[0]
    b = sliced.load_weights(0, 1, embeddings=False, head=False).layers[0]
    assert np.array_equal(a.wq, b.wq) and np.array_equal(a.w_down, b.w_down)


def test_passes_the_backend_conformance_suite(tiny: ModelFile) -> None:
    """One seat a context (the default): every item of a batch is its own decode, bitwise."""
    check_backend(
        lambda model, layers, threads=None: stagerun_llamacpp.LlamaCppBackend(
            model, layers, threads=1
        ),
        tiny,
        tolerance=1e-3,
    )


def test_shared_contexts_pass_the_conformance_suite_within_a_tolerance(tiny: ModelFile) -> None:
    """Four seats: sessions batch in one llama_decode. Measured: up to 1.2e-4 from alone."""
    check_backend(
        lambda model, layers, threads=None: stagerun_llamacpp.LlamaCppBackend(
            model, layers, threads=1, seats=4
        ),
        tiny,
        tolerance=1e-3,
        batch_tolerance=1e-3,
    )


def test_sessions_take_seats_and_give_them_back(tiny: ModelFile) -> None:
    backend = stagerun_llamacpp.LlamaCppBackend(tiny, threads=1, seats=2)
    a, b, c = (backend.new_cache() for _ in range(3))
    assert [a.seq, b.seq, c.seq] == [0, 1, 0] and a.context is b.context
    assert c.context is not a.context  # the first context was full
    backend.forward(a, 0, tokens=[1, 2, 3])
    backend.forward(b, 0, tokens=[4, 5])
    backend.forward(c, 0, tokens=[6])
    seat = b.seq
    del b
    again = backend.new_cache()
    assert (again.context, again.seq, again.length) == (a.context, seat, 0)
    # the seat's positions were forgotten: its sequence starts again at position 0
    fresh = stagerun_llamacpp.LlamaCppBackend(tiny, threads=1, seats=2)
    want = fresh.forward(fresh.new_cache(), 0, tokens=[7, 8])
    got = backend.forward(again, 0, tokens=[7, 8])
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    del c  # the second context is idle now: closed, the first stays
    assert backend._contexts == [a.context]
    with pytest.raises(ValueError, match="seats must lie in"):
        stagerun_llamacpp.LlamaCppBackend(tiny, seats=0)


def test_a_stop_cancels_one_item_of_a_shared_decode(tiny: ModelFile) -> None:
    backend = stagerun_llamacpp.LlamaCppBackend(tiny, threads=1, seats=4)
    caches = [backend.new_cache() for _ in range(3)]
    for cache in caches:
        backend.forward(cache, 0, tokens=[1, 2, 3, 4])
    polls = iter(range(100))
    out = backend.forward_batch(
        [
            ForwardItem(caches[0], 4, [5]),
            ForwardItem(caches[1], 2, [6, 7], should_stop=lambda: next(polls) >= 1),
            ForwardItem(caches[2], 4, [8], should_stop=lambda: False),
        ]
    )
    assert isinstance(out[1], ComputeCancelled) and caches[1].length == 2
    assert [c.length for c in (caches[0], caches[2])] == [5, 5]
    assert all(
        isinstance(o, np.ndarray) and o.shape == (1, tiny.config.vocab_size) for o in out[::2]
    )
    every = backend.forward_batch(
        [ForwardItem(c, 5, [9], should_stop=lambda: True) for c in (caches[0], caches[2])]
    )
    assert all(isinstance(o, ComputeCancelled) for o in every)
    assert [c.length for c in (caches[0], caches[2])] == [5, 5]


def test_a_prefill_longer_than_a_ubatch_gives_every_hidden_row(tmp_path: Path) -> None:
    """llama.cpp runs 512 rows a ubatch: the hidden states of each are collected in order."""
    model = open_model(write_tiny_model(tmp_path / "long.gguf", context_length=2048))
    ids = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, 700)]
    first = stagerun_llamacpp.LlamaCppBackend(model, (0, 2), threads=1)
    got = first.forward(first.new_cache(), 0, tokens=ids)
    reference = NumpyBackend(model, (0, 2))
    want = reference.forward(reference.new_cache(), 0, tokens=ids)
    assert got.shape == (700, model.config.d_model)
    # measured 2e-3 (float16 keys and values over 700 positions); a row out of place is O(1)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


@pytest.mark.slow
def test_logits_agree_with_numpy_on_the_default_model(smollm2: ModelFile) -> None:
    llama = stagerun_llamacpp.LlamaCppBackend(smollm2, threads=2)
    reference = NumpyBackend(smollm2)
    got_all, want_all, per_position = [], [], []
    for prompt in PROMPTS:
        ids = smollm2.tokenizer.encode(prompt)
        want = reference.forward(reference.new_cache(), 0, tokens=ids, logits="all")
        got = llama.forward(llama.new_cache(), 0, tokens=ids, logits="all")
        got_all.append(got)
        want_all.append(want)
        per_position += [np.corrcoef(g, w)[0, 1] for g, w in zip(got, want, strict=True)]
    got_set, want_set = np.concatenate(got_all), np.concatenate(want_all)
    # Measured: 0.99941 over the set, per position 0.9983 at worst and 0.9993 on average,
    # top-1 agreement 100% (llama.cpp multiplies Q4_1 weights by Q8-quantized activations).
    assert np.corrcoef(got_set.ravel(), want_set.ravel())[0, 1] >= 0.999
    assert np.mean(per_position) >= 0.999 and min(per_position) >= 0.995
    assert (got_set.argmax(-1) == want_set.argmax(-1)).mean() >= 0.95


@pytest.mark.slow
def test_shared_decodes_agree_with_decodes_alone_on_the_default_model(smollm2: ModelFile) -> None:
    """Four sessions decode 32 tokens each (teacher-forced), alone and as one batch.

    Measured (4 seats both ways): correlation 0.9988 at worst, 0.99963 on average, the
    largest logits 5.7e-2 of the largest apart (llama.cpp's 8-bit activations turn the least
    difference into a rounding step; against numpy it is as far), and the same greedy token
    at 125 of 128 steps, the others near-ties (runner-up within 0.3 of the top, of ~30).
    """
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    alone, shared = (
        stagerun_llamacpp.LlamaCppBackend(smollm2, threads=2, seats=4) for _ in range(2)
    )
    solo_caches = [alone.new_cache() for _ in ids]
    out = [alone.forward(c, 0, tokens=t) for c, t in zip(solo_caches, ids, strict=True)]
    caches = [shared.new_cache() for _ in ids]
    got = shared.forward_batch([ForwardItem(c, 0, t) for c, t in zip(caches, ids, strict=True)])
    agree = []
    for step in range(32):
        for want, have in zip(out, got, strict=True):
            assert isinstance(have, np.ndarray)
            assert np.corrcoef(want[0], have[0])[0, 1] >= 0.998
            top2 = np.sort(want[0])[-2:]
            agree.append(want.argmax() == have.argmax())
            assert agree[-1] or top2[1] - top2[0] < 0.5
        nxt = [int(o.argmax()) for o in out]
        positions = [len(t) + step for t in ids]
        out = [
            alone.forward(c, p, tokens=[n])
            for c, p, n in zip(solo_caches, positions, nxt, strict=True)
        ]
        got = shared.forward_batch(
            [ForwardItem(c, p, [n]) for c, p, n in zip(caches, positions, nxt, strict=True)]
        )
    assert np.mean(agree) >= 0.95


@pytest.mark.slow
def test_split_stages_agree_with_numpy(smollm2: ModelFile) -> None:
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    first = stagerun_llamacpp.LlamaCppBackend(smollm2, (0, 20), threads=2)
    last = stagerun_llamacpp.LlamaCppBackend(smollm2, (20, 30), threads=2)
    hidden = first.forward(first.new_cache(), 0, tokens=ids)
    reference = NumpyBackend(smollm2, (0, 20)).forward(
        NumpyBackend(smollm2, (0, 20)).new_cache(), 0, tokens=ids
    )
    cosine = (hidden * reference).sum() / np.linalg.norm(hidden) / np.linalg.norm(reference)
    assert hidden.shape == reference.shape and cosine > 0.999
    logits = last.forward(last.new_cache(), 0, hidden=hidden, logits="all")
    want = NumpyBackend(smollm2, (20, 30))
    expected = want.forward(want.new_cache(), 0, hidden=reference, logits="all")
    assert np.corrcoef(logits.ravel(), expected.ravel())[0, 1] >= 0.999


def test_stages_before_the_last_keep_no_head_and_compute_the_same(smollm2: ModelFile) -> None:
    """A slice before the last keeps 1,024 tokens of the vocabulary, so llama.cpp's graph
    ends in a small head; the first stage looks its embeddings up itself. Bitwise the same."""
    import llama_cpp

    ids = smollm2.tokenizer.encode(PROMPTS[2])
    whole = stagerun_llamacpp.LlamaCppBackend(smollm2, threads=2)
    want = whole.forward(whole.new_cache(), 0, tokens=ids, logits="all")
    stages = [
        stagerun_llamacpp.LlamaCppBackend(smollm2, r, threads=2)
        for r in ((0, 10), (10, 20), (20, 30))
    ]
    vocabularies = [
        llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(s._model)) for s in stages
    ]
    assert vocabularies == [1024, 1024, smollm2.config.vocab_size]
    got = stages[0].forward(stages[0].new_cache(), 0, tokens=ids, logits="all")
    for stage in stages[1:]:
        got = stage.forward(stage.new_cache(), 0, hidden=got, logits="all")
    assert np.array_equal(got, want)


@pytest.mark.slow
async def test_mixed_pipeline_numpy_llamacpp_torch() -> None:
    outputs = {}
    for backends in (("llamacpp",) * 3, ("numpy", "llamacpp", "torch")):
        async with open_pipeline("smollm2", stages=3, backends=list(backends)) as pipeline:
            result = await pipeline.complete(PROMPTS[0], max_tokens=16)
            outputs[backends] = result
    mixed = outputs[("numpy", "llamacpp", "torch")]
    assert "Paris" in mixed.text
    same = outputs[("llamacpp",) * 3].token_ids
    # Backends round differently: equal up to a near-tie, then free to differ.
    prefix = next(
        (i for i, (a, b) in enumerate(zip(mixed.token_ids, same, strict=False)) if a != b), 16
    )
    assert prefix >= 4, (mixed.text, outputs[("llamacpp",) * 3].text)
