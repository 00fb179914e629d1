"""The JSON shapes the OpenAI endpoints answer with (pure: no I/O).

Non-streaming answers carry ``usage`` and a llama-server style ``timings`` object. Streams are
``chat.completion.chunk`` (or ``text_completion``) objects: the first chat chunk carries
``role: assistant``, then content deltas, then one chunk with the ``finish_reason``; with
``stream_options.include_usage`` every chunk has ``usage: null`` and one more chunk with empty
``choices`` carries the usage (and, as an extension, the timings). ``data: [DONE]`` ends it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import attrs

from .._driver._values import Completion
from ._openai import GenerationRequest

DONE_EVENT = b"data: [DONE]\n\n"

TIMING_KEYS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second")


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def timings_json(timings: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's ``timings``: counts as integers, durations in milliseconds.

    Speculative requests add flags (kept as booleans) and per-depth occupancy lists.
    """
    out: dict[str, Any] = {}
    for key, value in timings.items():
        if isinstance(value, bool):
            out[key] = value
        elif isinstance(value, (list, tuple)):
            out[key] = [round(v, 3) if isinstance(v, float) else v for v in value]
        elif isinstance(value, float):
            out[key] = int(value) if key.endswith("_n") else round(value, 3)
        else:
            out[key] = value
    return out


def usage_json(result: Completion) -> dict[str, Any]:
    """OpenAI's ``usage``, with the prompt tokens restored from the prefix cache where clients
    read them (``prompt_tokens_details.cached_tokens``)."""
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.timings.prefill.prefix_cached_tokens},
    }


@attrs.frozen
class ResponseShape:
    """The fixed parts of every object one request answers with."""

    request: GenerationRequest
    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.request.kind == "chat"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, result: Completion) -> dict[str, Any]:
        """The whole non-streaming answer."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        choice["logprobs"] = None
        choice["finish_reason"] = result.finish_reason
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = [choice]
        body["usage"] = usage_json(result)
        body["timings"] = timings_json(result.timings)
        return body

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [] if choice is None else [choice]
        if self.request.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        """The chat stream's opening chunk (``role: assistant``); None for completions."""
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = None
        return self._chunk(choice)

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None}
        choice["finish_reason"] = finish_reason
        return self._chunk(choice)

    def usage_chunk(self, result: Completion) -> dict[str, Any]:
        body = self._chunk(None)
        body["usage"] = usage_json(result)
        body["timings"] = timings_json(result.timings)
        return body
