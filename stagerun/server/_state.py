"""What the HTTP handlers share, and the server's request limits."""

from __future__ import annotations

import time

import attrs

from .._driver._pipeline import Pipeline
from ._admission import Admission
from ._metrics import Metrics
from ._openai import ApiError

MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_TOKENS = 512  # a chat request that names no max_tokens
MAX_TOKENS_LIMIT = 4096  # no request generates more, whatever it asks for
DEFAULT_MAX_BATCH = 16  # requests generating at once (--max-batch)
DEFAULT_MAX_QUEUE = 64  # requests waiting for a slot and KV budget before 429 (--max-queue)


@attrs.define
class ServerState:
    """What the handlers share: the pipeline, admission, metrics and the served model id.

    ``kv_bytes_per_token`` prices a request's reservation: (prompt + max_tokens) tokens.
    """

    pipeline: Pipeline
    admission: Admission
    model_id: str
    model_aliases: frozenset[str]
    kv_bytes_per_token: int = 0
    metrics: Metrics = attrs.field(factory=Metrics)
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    health_timeout: float = 1.0
    started: int = attrs.field(factory=lambda: int(time.time()))

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.model_aliases:
            raise ApiError(
                404,
                f"the model {model!r} is not served here; use {self.model_id!r} "
                "(GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )
