"""What the HTTP handlers share: `ServerState` (the settings are `HttpConfig`'s)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio
from starlette.requests import Request

from .._driver._pipeline import Pipeline
from ._admission import Admission, CpuBudget, CpuBudgetExceeded
from ._config import DEFAULT_BODY_TIMEOUT as DEFAULT_BODY_TIMEOUT
from ._config import DEFAULT_COMPLETION_MAX_TOKENS as DEFAULT_COMPLETION_MAX_TOKENS
from ._config import DEFAULT_MAX_BATCH as DEFAULT_MAX_BATCH
from ._config import DEFAULT_MAX_QUEUE as DEFAULT_MAX_QUEUE
from ._config import DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from ._config import DEFAULT_REQUEST_TIMEOUT as DEFAULT_REQUEST_TIMEOUT
from ._config import DEFAULT_WRITE_TIMEOUT as DEFAULT_WRITE_TIMEOUT
from ._config import MAX_BODY_BYTES as MAX_BODY_BYTES
from ._config import MAX_TOKENS_LIMIT as MAX_TOKENS_LIMIT
from ._config import HttpConfig
from ._hosts import AllowedHosts as AllowedHosts
from ._hosts import split_host as split_host
from ._metrics import Metrics
from ._openai import ApiError

T = TypeVar("T")


@attrs.define
class ServerState:
    """What the handlers share: the pipeline, admission, metrics, the served model id and
    the server's settings (``http``).

    ``kv_bytes_per_token`` prices a request's reservation: (prompt + max_tokens) tokens.
    """

    pipeline: Pipeline
    admission: Admission
    model_id: str
    model_aliases: frozenset[str]
    kv_bytes_per_token: int = 0
    metrics: Metrics = attrs.field(factory=Metrics)
    http: HttpConfig = attrs.field(factory=HttpConfig)
    started: int = attrs.field(factory=lambda: int(time.time()))

    def model_entry(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "stagerun",
            "context_length": self.pipeline.config.context_length,
        }

    async def tokenized(
        self, work: Callable[[], T], *, budget: CpuBudget | None = None, size: int = 0
    ) -> T:
        """``work``'s result (token ids), computed in a tokenizer thread (`Admission.tokenize`)
        within ``budget``; ``size`` is the characters of text it takes.

        Raises:
            ApiError: 400 when a chat template refuses the messages (``param: messages``),
                429 when the tokenizer threads' line is full, 504 when the budget ran out.
        """
        try:
            ids = await self.admission.tokenize(work, budget=budget, size=size)
        except CpuBudgetExceeded:
            raise self.timeout_error() from None
        except ValueError as exc:  # a chat template that refuses the messages
            if budget is not None and budget.left() <= 0:  # its time was the request's
                raise self.timeout_error() from None
            raise ApiError(400, str(exc), param="messages") from exc
        if ids is None:
            raise ApiError(
                429,
                f"the server is busy ({self.admission.tokenizing} prompts being tokenized); "
                "retry after a second",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        return ids

    def budget(self, request: Request) -> CpuBudget:
        """A fresh budget for one tokenizer job of ``request``: until its deadline."""
        deadline = request.scope.get("stagerun.deadline")
        if not isinstance(deadline, float):
            deadline = trio.current_time() + self.http.request_timeout
        return CpuBudget(deadline)

    def timeout_error(self) -> ApiError:
        """The 504 of a request past ``request_timeout``."""
        timeout = self.http.request_timeout
        return ApiError(
            504,
            f"the request did not finish within the server's request timeout ({timeout:g} s); "
            "send a shorter prompt, or retry when the server is less busy",
            type="api_error",
            code="request_timeout",
        )

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.model_aliases:
            raise ApiError(
                404,
                f"the model {model!r} is not served here; use {self.model_id!r} "
                "(GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    state: ServerState = request.app.state.stagerun
    return state
