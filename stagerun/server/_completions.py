"""``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

A completion handler parses and checks the request (pure code in `._openai`), tokenizes the
prompt within the request's timeout (`_prompt_ids`), asks `Admission` for a ticket that
reserves the KV cache the request can grow to (400 when it could never fit ``--kv-budget``,
429 when the line is full) and returns a `GenerationResponse` that does the rest.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from .._driver._pipeline import Pipeline
from .._engine import GrammarError
from .._proto import SamplingParams
from .._proto._sampling_params import MAX_PROMPT_TOP_LOGPROBS
from ..model._chat import RENDER_TIMEOUT, ChatTemplateError
from ._admission import (
    SHORT_JOB_CHARS,
    CpuBudget,
    CpuBudgetExceeded,
    Ticket,
    encode_within,
    prompt_char_limit,
)
from ._api_values import invalid
from ._config import DEFAULT_COMPLETION_MAX_TOKENS
from ._generation import GenerationResponse
from ._grammars import Constraint
from ._openai import (
    ApiError,
    GenerationRequest,
    Kind,
    parse_generation_request,
    parse_json_body,
    too_long,
)
from ._responses import Choice, ResponseShape
from ._state import ServerState, server_state
from ._tools import ToolFormat, render_messages, tool_format, tool_grammar


async def read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(
        413,
        f"the request body is larger than {limit} bytes; shorten the prompt",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    # str.isdigit takes '²', which int() refuses; 20 digits or more is beyond any limit
    if length.isascii() and length.isdigit() and (len(length) >= 20 or int(length) > limit):
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer: no traceback in the log for a client's leaving
        raise ApiError(400, "the client left before its request body ended") from None
    return b"".join(chunks)


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [server_state(request).model_entry()]})


async def completions(request: Request) -> Response:
    return await _generation(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generation(request, "chat")


def over_context(at_least: int, context: int, param: str) -> ApiError:
    """The 400 of a text found to be over the context before it was tokenized whole."""
    return invalid(
        f"the prompt is at least {at_least} tokens long but the model's context is {context} "
        "tokens; shorten the prompt",
        param,
        code="context_length_exceeded",
    )


def render_within(
    pipeline: Pipeline, messages: Sequence[Mapping[str, Any]], budget: CpuBudget, **extra: Any
) -> str:
    """`Pipeline.render_chat` in the time ``budget`` has left (at most the template's own
    `RENDER_TIMEOUT`); in a tokenizer thread.

    Raises:
        CpuBudgetExceeded: the request's time ran out (before or during the render).
        ChatTemplateError: the template refused the messages, or ran out of its own time.
    """
    budget.check()
    try:
        return pipeline.render_chat(messages, timeout=min(RENDER_TIMEOUT, budget.left()), **extra)
    except ChatTemplateError:
        budget.check()  # out of the request's time: not the template's doing
        raise


async def _prompt_ids(
    request: Request, req: GenerationRequest, prompt: str | tuple[int, ...], size: int
) -> tuple[list[int], str]:
    """The prompt's token ids, and the request field they came from.

    Token ids are checked against the vocabulary here. Text is bounded by characters first
    (`prompt_char_limit`: a longer one could never fit the context), then rendered (a chat) and
    tokenized in a tokenizer thread (`Admission.tokenize`, 429 when its line is full; ``size``
    characters sort it as a short or a long job), so neither a long prompt nor a slow chat
    template holds up the event loop; both count against the request's timeout (504), and a
    text far over the context is refused after a few pieces (`encode_within`).
    """
    state = server_state(request)
    pipeline = state.pipeline
    if isinstance(prompt, tuple):
        vocab = pipeline.config.vocab_size
        for i, token in enumerate(prompt):
            if token >= vocab:
                raise ApiError(
                    400,
                    f"token id {token} at prompt[{i}] is outside the vocabulary (0..{vocab - 1})",
                    param="prompt",
                )
        return list(prompt), "prompt"
    context = pipeline.config.context_length
    limit = prompt_char_limit(pipeline.tokenizer, context)
    param = "messages" if req.kind == "chat" else "prompt"
    budget = state.budget(request)

    def bounded(text: str) -> str:
        if len(text) > limit:
            why = f", which no text over {limit} characters fits"
            raise too_long(len(text), "characters", context, param, why)
        return text

    def tokenize() -> list[int] | int:  # in a worker thread
        if req.kind == "completion":  # (Pipeline.encode_prompt, within the budget)
            return encode_within(pipeline.tokenizer, prompt, context - 1, budget)
        fmt = tool_format(pipeline.effective_chat_template)
        messages, extra = render_messages([m.for_template() for m in req.messages], req.tools, fmt)
        # ModelFile.apply_chat_template's two steps, with the bound between them
        text = bounded(render_within(pipeline, messages, budget, **extra))
        return encode_within(pipeline.tokenizer, text, context - 1, budget, add_bos=False)

    if req.kind == "completion":
        bounded(prompt)
    ids = await state.tokenized(tokenize, budget=budget, size=size)
    if isinstance(ids, int):
        raise over_context(ids, context, param)
    return ids, param


async def _generation(request: Request, kind: Kind) -> Response:
    state = server_state(request)
    body = await read_body(request, state.http.max_body_bytes)
    context = state.pipeline.config.context_length
    req = parse_generation_request(parse_json_body(body), kind, context_length=context)
    state.check_model(req.model)
    prompts = []
    for prompt in req.prompts or (req.prompt,):
        prompt_ids, param = await _prompt_ids(request, req, prompt, len(body))
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty after tokenization: give some text",
                           param=param)  # fmt: skip
        if len(prompt_ids) >= context:
            raise too_long(len(prompt_ids), "tokens", context, param)
        prompts.append((prompt, prompt_ids))
    longest = max(len(ids) for _, ids in prompts)
    room = min(context - longest, state.http.max_tokens_limit)
    if req.max_tokens is not None:
        max_tokens = min(req.max_tokens, room)
    elif kind == "completion":
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    else:
        max_tokens = min(state.http.max_tokens_default, room)
    sampling, fmt = await _sampling(state, req, longest, state.budget(request))
    choices = []
    for k, (prompt, prompt_ids) in enumerate(prompts):
        echo = None
        if req.echo:
            echo = (
                prompt if isinstance(prompt, str) else state.pipeline.tokenizer.decode(prompt_ids)
            )
        for j in range(req.n):  # each choice its own seed, derived from the request's
            seed = (sampling.seed + j * _SEED_STEP) % 2**64
            choice_sampling = attrs.evolve(sampling, seed=seed)
            choices.append(Choice(k * req.n + j, prompt_ids, choice_sampling, echo))
    ticket = _admit(state, longest, max_tokens)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    shape = ResponseShape(
        req,
        prefix + secrets.token_hex(12),
        req.model,
        token_bytes=state.pipeline.tokenizer.token_bytes,
        tool_format=fmt,
    )
    return GenerationResponse(
        state,
        shape,
        choices,
        max_tokens=max_tokens,
        ticket=ticket,
        label=request.scope.get("stagerun.request_id"),
    )


_SEED_STEP = 0x9E3779B97F4A7C15  # choice j's seed is the request's plus j of these (mod 2**64)
# A scored prompt's logprobs travel in one reply header (1 MiB): about 9 bytes per logprob
# and 14 per alternative, kept well under it.
MAX_SCORED_BYTES = 900_000


async def _sampling(
    state: ServerState, req: GenerationRequest, longest: int, budget: CpuBudget
) -> tuple[SamplingParams, ToolFormat | None]:
    """The request's sampling settings (grammar included), and its tool format if any."""
    vocab = state.pipeline.config.vocab_size
    for token, _ in req.knobs.logit_bias:
        if token >= vocab:
            raise ApiError(400, f"'logit_bias' names token {token}, outside the vocabulary "
                           f"(0..{vocab - 1})", param="logit_bias")  # fmt: skip
    sampling = req.knobs.sampling_params(secrets.randbits(63) if req.seed is None else req.seed)
    if req.echo:  # the prompt's logprobs, when asked for (a prompt is always run)
        top = max(req.knobs.logprobs, 0)
        if top > MAX_PROMPT_TOP_LOGPROBS:
            raise ApiError(400, f"with 'echo', 'logprobs' is at most {MAX_PROMPT_TOP_LOGPROBS}",
                           param="logprobs")  # fmt: skip
        if longest * (9 + 14 * top) > MAX_SCORED_BYTES:
            fits = MAX_SCORED_BYTES // (9 + 14 * top)
            raise ApiError(400, f"'echo' with 'logprobs' {top} scores prompts of at most {fits} "
                           f"tokens; this one has {longest}", param="prompt")  # fmt: skip
        sampling = attrs.evolve(sampling, prompt_logprobs=top)
    constraint, fmt = req.constraint, None
    if req.tools is not None:
        fmt = tool_format(state.pipeline.effective_chat_template)
        grammar = tool_grammar(req.tools, fmt)
        constraint = None if grammar is None else Constraint("tools", grammar)
    if constraint is not None:
        await check_constraint(state, constraint, budget)
        sampling = attrs.evolve(sampling, grammar=constraint.grammar)
    return sampling, fmt


def _admit(state: ServerState, prompt_tokens: int, max_tokens: int) -> Ticket:
    """A ticket reserving the KV cache of (prompt + max_tokens) tokens, or the refusal."""
    adm = state.admission
    tokens = prompt_tokens + max_tokens
    reserve = tokens * state.kv_bytes_per_token
    if adm.never_fits(reserve):
        fits = (adm.kv_budget or 0) // max(state.kv_bytes_per_token, 1)
        raise ApiError(
            400,
            f"the request needs KV cache for {tokens} tokens ({prompt_tokens} of prompt + "
            f"max_tokens {max_tokens}, {reserve} bytes) but the server's --kv-budget "
            f"({adm.kv_budget} bytes) holds {fits} tokens; shorten the prompt or max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    ticket = adm.try_admit(reserve)
    if ticket is None:
        raise ApiError(
            429,
            f"the server is busy ({adm.running} requests running, {adm.queued} waiting); "
            "retry after a second",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    return ticket


async def check_constraint(
    state: ServerState, constraint: Constraint, budget: CpuBudget | None = None
) -> None:
    """Compile ``constraint`` over the model's vocabulary once; a 400 if it does not compile.

    A compile cannot be interrupted: past the ``budget``'s deadline the request gets its 504
    and the compile finishes in its thread (a long job: never the last one)."""
    grammars = state.pipeline.engine.grammars
    assert grammars is not None, "a pipeline's stage 0 always has its model's grammars"

    def check() -> bool:
        grammars.check(constraint.grammar)
        return True

    try:
        checked = await state.admission.tokenize(check, budget=budget, size=SHORT_JOB_CHARS + 1)
    except GrammarError as exc:
        raise invalid(f"'{constraint.param}' does not compile: {exc}", constraint.param) from None
    except CpuBudgetExceeded:
        raise state.timeout_error() from None
    if checked is None:
        raise ApiError(
            429,
            "the server is busy compiling and tokenizing other requests; retry after a second",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
