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
from .._proto import SamplingParams
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


def usage_json(results: Sequence[Completion]) -> dict[str, Any]:
    """OpenAI's ``usage`` over a request's choices, with the prompt tokens restored from the
    prefix cache where clients read them (``prompt_tokens_details.cached_tokens``).

    Each distinct prompt counts once (``n`` choices of one prompt share it).
    """
    seen: set[tuple[int, ...]] = set()
    prompt = cached = 0
    for result in results:
        key = tuple(result.prompt_token_ids)
        if key not in seen:
            seen.add(key)
            prompt += len(key)
            cached += result.timings.prefill.prefix_cached_tokens
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@attrs.frozen
class Choice:
    """One answer a request asks for: its prompt and settings, and where it goes.

    ``echo`` is the prompt's text, for a completion that echoes it before its answer.
    """

    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    echo: str | None = None


Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None]
"""A token's logprobs as an answer shows them: id, logprob and top ones (None: unscored)."""


def entries(logprobs: Sequence[TokenLogprob] | None) -> list[Entry] | None:
    """Generated tokens' logprobs as `Entry` values (None when not asked for)."""
    if logprobs is None:
        return None
    return [(e.token_id, e.logprob, e.top) for e in logprobs]


def echo_entries(choice: Choice, result: Completion) -> list[Entry]:
    """The prompt's tokens' logprobs (the first is unscored), for an echoing completion."""
    scored = result.prompt_logprobs or []
    out: list[Entry] = [(choice.prompt_ids[0], None, None)]
    out.extend((e.token_id, e.logprob, e.top) for e in scored[1:] if e is not None)
    return out


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

    def spelled_length(self, items: Sequence[Entry]) -> int:
        """The characters of ``items``' tokens, as `logprobs_json` spells them."""
        return sum(len(self._spelled(token)[0]) for token, _, _ in items)

    def logprobs_json(
        self, items: Sequence[Entry] | None, offset: int = 0
    ) -> dict[str, Any] | None:
        """``logprobs`` of a choice (or a chunk) for ``items``: chat's or completions' shape.

        ``offset`` is where the first token's text starts in the completion's text.
        """
        if items is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(item) for item in items], "refusal": None}
        tokens, offsets = [], []
        tops: list[dict[str, float | None] | None] = []
        for token, logprob, top in items:
            text, _ = self._spelled(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if top is None:
                tops.append(None)
                continue
            shown: dict[str, float | None] = {self._spelled(t)[0]: value for t, value in top}
            shown.setdefault(text, logprob)  # the chosen token's too, as OpenAI's
            tops.append(shown)
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in items],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, item: Entry) -> dict[str, Any]:
        token, logprob, top = item
        text, raw = self._spelled(token)
        shown = []
        for other, value in top or ():
            top_text, top_raw = self._spelled(other)
            shown.append({"token": top_text, "logprob": value, "bytes": top_raw})
        return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": shown}

    @property
    def chat(self) -> bool:
        return self.request.kind == "chat"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, answers: Sequence[tuple[Choice, Completion]]) -> dict[str, Any]:
        """The whole non-streaming answer, one choice per answer."""
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice(choice, result) for choice, result in answers]
        results = [result for _, result in answers]
        body["usage"] = usage_json(results)
        body["timings"] = timings_json(results[0].timings)
        return body

    def _choice(self, choice: Choice, result: Completion) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        finish: str = result.finish_reason
        items = entries(result.logprobs)
        if self.chat:
            out["message"], finish = self.message(result)
        elif choice.echo is not None:
            out["text"] = choice.echo + result.text
            if items is not None:
                items = echo_entries(choice, result) + items
        else:
            out["text"] = result.text
        out["logprobs"] = self.logprobs_json(items)
        out["finish_reason"] = finish
        return out

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [] if choice is None else [choice]
        if self.request.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """The chat stream's opening chunk (``role: assistant``); None for completions."""
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk(
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        )

    def text_chunk(
        self,
        text: str,
        logprobs: Sequence[Entry] | None = None,
        offset: int = 0,
        *,
        index: int = 0,
    ) -> dict[str, Any]:
        """A chunk of ``text``, with the ``logprobs`` of the tokens it completes."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs_json(logprobs, offset)
        choice["finish_reason"] = None
        return self._chunk(choice)

    def finish_chunk(
        self,
        finish_reason: str,
        logprobs: Sequence[Entry] | None = None,
        offset: int = 0,
        *,
        index: int = 0,
    ) -> dict[str, Any]:
        """The chunk that ends the choice (with the logprobs of tokens no text showed yet)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice["logprobs"] = self.logprobs_json(logprobs, offset) if logprobs else None
        choice["finish_reason"] = finish_reason
        return self._chunk(choice)

    def held_chunks(self, result: Completion, index: int = 0) -> tuple[list[dict[str, Any]], str]:
        """A held-back stream's content and ``tool_calls`` deltas, and its finish reason."""
        message, finish = self.message(result)
        chunks = []
        if message["content"]:
            chunks.append(
                self.text_chunk(message["content"], entries(result.logprobs), index=index)
            )
        for number, call in enumerate(message.get("tool_calls", [])):
            delta = {"tool_calls": [{"index": number, **call}]}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            chunks.append(self._chunk(choice))
        return chunks, finish

    def usage_chunk(self, results: Sequence[Completion]) -> dict[str, Any]:
        body = self._chunk(None)
        body["usage"] = usage_json(results)
        body["timings"] = timings_json(results[0].timings)
        return body
