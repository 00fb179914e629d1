#!/usr/bin/env bash
# CUDA smoke test of the torch backend: on a machine with an NVIDIA GPU, in under 5 minutes.
#
#   plugins/stagerun-torch/scripts/cuda_smoke.sh            # from the repository root
#   plugins/stagerun-torch/scripts/cuda_smoke.sh cpu        # the same checks on the CPU (CI)
#
# Uses .venv if present (make install), else python3.11 with stagerun installed. Checks that the
# backend runs on cuda, that float32 logits match the numpy reference within 1e-3 relative on
# the default model, that float16 agrees on the greedy token (CUDA only), that a batch of
# sessions gives each one bitwise its own result alone, and that a 3-stage pipeline of torch
# stages generates the same greedy tokens as numpy stages.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3.11
export SMOKE_DEVICE=${1:-cuda}
timeout 300 "$PY" - <<'PY'
import os
import time

import numpy as np
import torch
import trio

from stagerun import open_pipeline
from stagerun.abc import ForwardItem
from stagerun.backends import NumpyBackend
from stagerun.model import open_model
from stagerun_torch import TorchBackend

device = os.environ["SMOKE_DEVICE"]
cuda = device.startswith("cuda")
if cuda:
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    print("device:", torch.cuda.get_device_name(device))


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


model = open_model("smollm2")
ids = model.tokenizer.encode("The capital of France is")
want = NumpyBackend(model).forward(NumpyBackend(model).new_cache(), 0, tokens=ids, logits="all")
for dtype, bound in (("float32", 1e-3), ("float16", 5e-2))[: 2 if cuda else 1]:
    backend = TorchBackend(model, device=device, dtype=dtype)
    got = backend.forward(backend.new_cache(), 0, tokens=ids, logits="all")
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(f"{dtype}: relative difference {rel:.2e}, top-1 agreement {top1:.2f}")
    assert rel < bound and top1 >= 0.9, dtype
    cache = backend.new_cache()
    backend.forward(cache, 0, tokens=ids)
    sync()
    start = time.perf_counter()
    for i in range(32):
        backend.forward(cache, len(ids) + i, tokens=[ids[-1]])
    sync()
    print(f"{dtype}: {32 / (time.perf_counter() - start):.1f} decode steps/s")
    prompts = [ids, ids[:3], ids[-1:], ids * 20]
    alone = [backend.forward(backend.new_cache(), 0, tokens=p, logits="all") for p in prompts]
    items = [ForwardItem(backend.new_cache(), 0, p, logits="all") for p in prompts]
    batched = backend.forward_batch(items)
    gaps = [float(np.abs(b - a).max()) for a, b in zip(alone, batched)]
    print(f"{dtype}: a batch of {len(prompts)} against alone, largest differences {gaps}")
    assert all(np.array_equal(a, b) for a, b in zip(alone, batched)), dtype


async def tokens(backend: str) -> list[int]:
    on = {"device": device} if backend == "torch" else {}
    async with open_pipeline("smollm2", stages=3, backend=backend, **on) as pipeline:
        return (await pipeline.complete("The capital of France is", max_tokens=16)).token_ids


assert trio.run(tokens, "torch") == trio.run(tokens, "numpy")
print("3-stage torch pipeline: same greedy tokens as numpy")
print(f"SMOKE OK on {device}")
PY
