"""The llama-server drafter against a real llama-server process on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from stagerun_llamacpp import LlamaServerDrafter

from stagerun import SpeculationConfig, open_pipeline, plugins
from stagerun._driver._values import DrafterContext
from stagerun.model import open_model, resolve_model

ROOT = Path(__file__).resolve().parents[3]
PROMPT = (
    "Repeat the following text exactly, word for word: The lighthouse keeper climbed the one "
    "hundred and twelve stairs every evening, wound the clockwork and lit the great lamp."
)


def _binary() -> Path:
    path = Path(
        os.environ.get("STAGERUN_LLAMA_SERVER_BIN", ROOT / ".cache/llama.cpp/bin/llama-server")
    )
    assert path.exists(), (
        f"no llama-server at {path}: run plugins/stagerun-llamacpp/scripts/build.sh "
        "(make test does)"
    )
    return path


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(_binary()), "-m", str(resolve_model("smollm2")), "--host", "127.0.0.1",
         "--port", str(port), "-c", "2048", "-np", "1", "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if json.loads(reply.read()).get("status") == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_registered() -> None:
    plugins.refresh()
    assert plugins.drafter("llama-server") is LlamaServerDrafter


def test_needs_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAGERUN_LLAMA_SERVER", raising=False)
    options = DrafterContext(open_model("smollm2"), "model.gguf")
    with pytest.raises(ValueError, match="needs the server's URL"):
        LlamaServerDrafter.create(options)
    monkeypatch.setenv("STAGERUN_LLAMA_SERVER", "http://127.0.0.1:1")
    assert LlamaServerDrafter.create(DrafterContext(options.target)).url == "http://127.0.0.1:1"


def test_a_dead_server_proposes_nothing() -> None:
    drafter = LlamaServerDrafter("http://127.0.0.1:1", timeout=1)
    assert drafter.propose([1, 2, 3], 4) == []
    assert drafter.failures == 1 and drafter.last_error


@pytest.mark.llama_cpp
def test_proposals_continue_the_context(llama_server: str) -> None:
    drafter = LlamaServerDrafter(llama_server)
    context = [1, 504, 3458, 282]  # any ids of the shared vocabulary
    drafts = drafter.propose(context, 4)
    assert 1 <= len(drafts) <= 4 and all(isinstance(t, int) for t in drafts)
    assert drafter.propose(context, 4) == drafts  # greedy: deterministic


@pytest.mark.slow
@pytest.mark.llama_cpp
async def test_speculation_with_llama_server_equals_plain_decoding(llama_server: str) -> None:
    async with open_pipeline("smollm2", stages=3) as pipeline:
        plain = await pipeline.complete(PROMPT, chat=True, max_tokens=48)
        spec = await pipeline.complete(
            PROMPT,
            chat=True,
            max_tokens=48,
            speculation=SpeculationConfig(
                "llama-server", depth=2, window=4, draft_model=llama_server
            ),
        )
    assert spec.token_ids == plain.token_ids
    timings = spec.timings
    print(
        f"llama-server drafter: proposed {timings['speculative_proposed_n']}, accepted "
        f"{timings['speculative_accepted_n']} ({timings['speculative_accept_rate']:.2f})"
    )
    assert timings["speculative_proposed_n"] > 0
    assert timings["speculative_accept_rate"] > 0.5  # the same model drafts: mostly right
