"""``POST /tokenize``, ``POST /detokenize`` and ``GET /v1/models/{id}``.

The two tokenizer endpoints take llama-server's fields and vLLM's: ``/tokenize`` text as
``content`` (llama-server: no BOS unless ``add_special``) or ``prompt`` (vLLM: the model's BOS
unless ``add_special_tokens`` is false), or chat ``messages`` rendered by the chat template;
``with_pieces`` (llama-server) gives each id with its text (its bytes, where they are
not UTF-8 on their own). ``/detokenize`` takes ``tokens``.
Both answer with the field names of both (``tokens``, ``count``, ``max_model_len``;
``content`` and ``prompt``). Text is bounded as a prompt is: by characters, then by the
context's tokens (a longer text is refused after a few pieces, `encode_within`), tokenized in
the tokenizer threads (429 when their line is full) within the request's timeout (504); ids
are bounded by the context and checked against the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._admission import encode_within, prompt_char_limit
from ._api_values import invalid, json_type, optional_bool
from ._completions import over_context, read_body, render_within
from ._openai import ChatMessage, checked_text, parse_json_body, parse_messages, token_ids, too_long
from ._state import ServerState, server_state

__all__ = ["detokenize", "model", "parse_detokenize", "parse_tokenize", "tokenize"]

_TOKENIZE_FIELDS = frozenset(
    {"model", "content", "prompt", "messages", "add_special", "add_special_tokens",
     "add_generation_prompt", "with_pieces"}
)  # fmt: skip
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@attrs.frozen
class TokenizeRequest:
    model: str | None
    text: str = ""
    messages: tuple[ChatMessage, ...] = ()
    add_special: bool = False
    add_generation_prompt: bool = True
    with_pieces: bool = False


def _known(data: Mapping[str, Any], fields: frozenset[str], path: str) -> str | None:
    for name in data:
        if name not in fields:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise invalid(f"'{shown}' is not a field {path} takes; leave it out", shown)
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid(f"'model' must be a non-empty string, not {json_type(model)}", "model")
    return model


def parse_tokenize(data: Mapping[str, Any], context: int) -> TokenizeRequest:
    """Check a ``/tokenize`` body: exactly one of ``content``, ``prompt`` or ``messages``."""
    model = _known(data, _TOKENIZE_FIELDS, "/tokenize")
    given = [name for name in ("content", "prompt", "messages") if data.get(name) is not None]
    if len(given) != 1:
        raise invalid("send exactly one of 'content', 'prompt' or 'messages'", None)
    (field,) = given
    with_pieces = bool(optional_bool(data, "with_pieces"))
    generation = optional_bool(data, "add_generation_prompt")
    if field == "messages":
        return TokenizeRequest(
            model,
            messages=parse_messages(data[field], context),
            add_generation_prompt=True if generation is None else generation,
            with_pieces=with_pieces,
        )
    text = data[field]
    if not isinstance(text, str):
        raise invalid(f"'{field}' must be a string, not {json_type(text)}", field)
    # llama-server adds no BOS unless asked; vLLM adds the model's unless told not to
    special = optional_bool(data, "add_special" if field == "content" else "add_special_tokens")
    return TokenizeRequest(
        model,
        text=checked_text(text, field),
        add_special=field == "prompt" if special is None else special,
        with_pieces=with_pieces,
    )


def parse_detokenize(data: Mapping[str, Any], context: int) -> tuple[str | None, tuple[int, ...]]:
    """Check a ``/detokenize`` body: the model (optional) and at most ``context`` token ids."""
    model = _known(data, _DETOKENIZE_FIELDS, "/detokenize")
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise invalid(f"'tokens' must be an array of token ids, not {json_type(tokens)}", "tokens")
    if len(tokens) > context:
        raise invalid(
            f"'tokens' holds {len(tokens)} ids, more than the model's context ({context})",
            "tokens",
        )
    return model, token_ids(tokens, "tokens")


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    pipeline = state.pipeline
    context = pipeline.config.context_length
    body = await _body(request, state)
    req = parse_tokenize(parse_json_body(body), context)
    if req.model is not None:
        state.check_model(req.model)
    limit = prompt_char_limit(pipeline.tokenizer, context)
    param = "messages" if req.messages else "content"

    def bounded(text: str) -> str:
        if len(text) > limit:
            raise too_long(len(text), "characters", context, param, f", which no text over "
                           f"{limit} characters fits")  # fmt: skip
        return text

    budget = state.budget(request)

    def work() -> list[int] | int:  # in a tokenizer thread
        tokenizer = pipeline.tokenizer
        if req.messages:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            generation = req.add_generation_prompt
            text = render_within(pipeline, messages, budget, add_generation_prompt=generation)
            return encode_within(tokenizer, bounded(text), context, budget, add_bos=False)
        return encode_within(tokenizer, bounded(req.text), context, budget, add_bos=req.add_special)

    bounded(req.text)
    ids = await state.tokenized(work, budget=budget, size=len(body))
    if isinstance(ids, int):
        raise over_context(ids, context, param)
    tokens: list[Any] = list(ids)
    if req.with_pieces:
        tokens = [{"id": i, "piece": _piece(pipeline.tokenizer.token_bytes(i))} for i in ids]
    return JSONResponse({"tokens": tokens, "count": len(ids), "max_model_len": context})


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    pipeline = state.pipeline
    model, ids = parse_detokenize(
        parse_json_body(await _body(request, state)), pipeline.config.context_length
    )
    if model is not None:
        state.check_model(model)
    vocab = pipeline.config.vocab_size
    for i, token in enumerate(ids):
        if token >= vocab:
            raise invalid(f"token id {token} at tokens[{i}] is outside the vocabulary "
                          f"(0..{vocab - 1})", "tokens")  # fmt: skip
    text = pipeline.tokenizer.decode(ids)
    return JSONResponse({"content": text, "prompt": text})


async def model(request: Request) -> Response:
    """One model's entry (``client.models.retrieve``): the served id or one of its aliases."""
    state = server_state(request)
    state.check_model(request.path_params["model"])
    return JSONResponse(state.model_entry())


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 alone (as llama-server)."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return list(data)


async def _body(request: Request, state: ServerState) -> bytes:
    return await read_body(request, state.http.max_body_bytes)
