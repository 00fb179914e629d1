"""The examples in examples/ run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_embed_pipeline_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "embed_pipeline.py"), "The capital of France is"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in out.stdout
    assert "tokens at" in out.stderr


@pytest.mark.slow
def test_concurrent_requests_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "concurrent_requests.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    for line in ("health: [(0, 'ready'), (1, 'ready')]", "cancelled: returned cancelled",
                 "deadline: gave up after 0.5 s", "first: finished", "second: finished",
                 "after: finished", "closed; health now ['closed', 'closed']"):  # fmt: skip
        assert line in out, out
