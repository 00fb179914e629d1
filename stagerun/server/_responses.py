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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .._driver._values import Completion, TokenLogprob
from ._openai import GenerationRequest
from ._tools import ToolFormat, parse_tool_output

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


def _no_bytes(token_id: int) -> bytes:
    return b""


@attrs.frozen
class ResponseShape:
    """The fixed parts of every object one request answers with.

    ``token_bytes`` gives a token's bytes, to spell the tokens of ``logprobs``.
    """

    request: GenerationRequest
    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))
    token_bytes: Callable[[int], bytes] = _no_bytes
    tool_format: ToolFormat | None = None  # a chat with tools: parse calls out of the answer

    @property
    def holds_text(self) -> bool:
        """Whether a stream holds its text back to the end (tool calls are parsed from it)."""
        return self.tool_format is not None

    def message(self, result: Completion) -> tuple[dict[str, Any], str]:
        """A chat answer's message, and its finish reason (``tool_calls`` when it calls)."""
        if self.tool_format is None:
            return {"role": "assistant", "content": result.text}, result.finish_reason
        content, calls = parse_tool_output(result.text, self.tool_format)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, result.finish_reason
        message["tool_calls"] = calls
        return message, "tool_calls"

    def _spelled(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def spelled_length(self, entries: Sequence[TokenLogprob]) -> int:
        """The characters of ``entries``' tokens, as `logprobs_json` spells them."""
        return sum(len(self._spelled(entry.token_id)[0]) for entry in entries)

    def logprobs_json(
        self, entries: Sequence[TokenLogprob] | None, offset: int = 0
    ) -> dict[str, Any] | None:
        """``logprobs`` of a choice (or a chunk) for ``entries``: chat's or completions' shape.

        ``offset`` is where the first token's text starts in the completion's text.
        """
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(entry) for entry in entries], "refusal": None}
        tokens, offsets, tops = [], [], []
        for entry in entries:
            text, _ = self._spelled(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top = {self._spelled(token)[0]: logprob for token, logprob in entry.top}
            top.setdefault(text, entry.logprob)  # the chosen token's too, as OpenAI's
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        text, raw = self._spelled(entry.token_id)
        top = []
        for token, logprob in entry.top:
            top_text, top_raw = self._spelled(token)
            top.append({"token": top_text, "logprob": logprob, "bytes": top_raw})
        return {"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top}

    @property
    def chat(self) -> bool:
        return self.request.kind == "chat"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, result: Completion) -> dict[str, Any]:
        """The whole non-streaming answer."""
        choice: dict[str, Any] = {"index": 0}
        finish: str = result.finish_reason
        if self.chat:
            choice["message"], finish = self.message(result)
        else:
            choice["text"] = result.text
        choice["logprobs"] = self.logprobs_json(result.logprobs)
        choice["finish_reason"] = finish
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

    def text_chunk(
        self, text: str, logprobs: Sequence[TokenLogprob] | None = None, offset: int = 0
    ) -> dict[str, Any]:
        """A chunk of ``text``, with the ``logprobs`` of the tokens it completes."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs_json(logprobs, offset)
        choice["finish_reason"] = None
        return self._chunk(choice)

    def finish_chunk(
        self, finish_reason: str, logprobs: Sequence[TokenLogprob] | None = None, offset: int = 0
    ) -> dict[str, Any]:
        """The chunk that ends the choice (with the logprobs of tokens no text showed yet)."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice["logprobs"] = self.logprobs_json(logprobs, offset) if logprobs else None
        choice["finish_reason"] = finish_reason
        return self._chunk(choice)

    def held_chunks(self, result: Completion) -> tuple[list[dict[str, Any]], str]:
        """A held-back stream's content and ``tool_calls`` deltas, and its finish reason."""
        message, finish = self.message(result)
        chunks = []
        if message["content"]:
            chunks.append(self.text_chunk(message["content"], result.logprobs))
        for index, call in enumerate(message.get("tool_calls", [])):
            delta = {"tool_calls": [{"index": index, **call}]}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            chunks.append(self._chunk(choice))
        return chunks, finish

    def usage_chunk(self, result: Completion) -> dict[str, Any]:
        body = self._chunk(None)
        body["usage"] = usage_json(result)
        body["timings"] = timings_json(result.timings)
        return body
