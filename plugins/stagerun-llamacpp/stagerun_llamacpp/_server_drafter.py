"""The ``llama-server`` drafter: draft tokens from a llama.cpp server on another process or host.

Each proposal asks the server to continue the query context greedily (``POST /completion`` with
the context as token ids, ``n_predict`` = the drafts wanted, ``cache_prompt`` so the server
reuses its KV cache for the shared prefix, which grows by a few tokens per window). The server
must run a model with the target's vocabulary (the same model, a smaller one, or a layer slice).
Blocking code: the runtime calls it from a worker thread.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from stagerun.abc import Drafter, DrafterOptions

__all__ = ["LlamaServerDrafter"]

URL_ENV = "STAGERUN_LLAMA_SERVER"


class LlamaServerDrafter(Drafter):
    """Greedy drafts from ``llama-server`` at ``url`` (e.g. ``http://127.0.0.1:8080``).

    Args:
        url: the server's base URL.
        timeout: seconds to wait for one proposal; a slow or failed call proposes nothing
            (the window then verifies no drafts), it never fails the request.
    """

    name = "llama-server"
    per_request = False  # stateless HTTP: one client per pipeline

    @classmethod
    def create(cls, options: DrafterOptions) -> LlamaServerDrafter:
        url = options.draft_model or os.environ.get(URL_ENV)
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(
                "the llama-server drafter needs the server's URL: --draft-model "
                f"http://HOST:PORT (or ${URL_ENV})"
            )
        return cls(url)

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.calls = 0
        self.failures = 0
        self.last_error: str | None = None

    def __repr__(self) -> str:
        return f"<LlamaServerDrafter {self.url} calls={self.calls} failures={self.failures}>"

    def begin(self, prompt: Sequence[int]) -> None:
        pass  # the server's prompt cache follows whatever context comes next

    def commit(self, tokens: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or not context:
            return []
        body = {
            "prompt": [int(t) for t in context],
            "n_predict": int(max_tokens),
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "return_tokens": True,
            "stream": False,
        }
        self.calls += 1
        try:
            reply = self._post("/completion", body)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return []
        tokens = reply.get("tokens") or []
        return [int(t) for t in tokens[:max_tokens]]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            reply: dict[str, Any] = json.loads(response.read())
        return reply
