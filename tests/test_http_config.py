"""`HttpConfig`: every setting of the HTTP server declared and checked once."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from stagerun.server import HttpConfig, ServeOptions
from stagerun.server import _config as http

INVALID: dict[str, Any] = {
    "host": None,
    "port": 70000,
    "max_batch": 0,
    "max_queue": -1,
    "kv_budget": 0,
    "max_body_bytes": 0,
    "max_tokens_default": 0,
    "max_tokens_limit": 0,
    "allowed_hosts": ("http://x",),
    "request_timeout": 0.0,
    "write_timeout": -1.0,
    "body_timeout": math.nan,
    "health_timeout": 0,
    "max_connections": 0,
    "max_connections_per_client": 0,
    "max_bodies_per_client": -1,
    "prefix_share": "everyone",
    "metrics_auth": "open",
    "ui": "yes",
}
# Any key passes here: `resolve_api_key` refuses an empty one, or a key given twice.
UNCHECKED = {"api_key", "api_key_file"}


def test_every_setting_but_the_key_has_its_check() -> None:
    fields = {field.name for field in attrs.fields(HttpConfig)}
    assert set(INVALID) | UNCHECKED == fields
    assert set(http._CHECKS) == set(INVALID)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_each_setting_is_refused_in_one_sentence(name: str) -> None:
    with pytest.raises(ValueError) as refused:
        HttpConfig(**{name: INVALID[name]})
    message = str(refused.value)
    assert "\n" not in message
    if name != "allowed_hosts":  # its parser names the entry at fault instead
        assert message.endswith(f"@ HttpConfig.{name}")
    with pytest.raises(ValueError):
        HttpConfig().replace(**{name: INVALID[name]})  # an evolved copy is checked again


def test_serve_options_are_an_http_config_checked_the_same_way() -> None:
    options = ServeOptions(max_batch=3, api_key="k", write_timeout=2.0)
    assert isinstance(options, HttpConfig)
    assert options.http == HttpConfig(max_batch=3, api_key="k", write_timeout=2.0)
    assert ServeOptions().max_batch == http.DEFAULT_MAX_BATCH and HttpConfig().max_batch is None
    with pytest.raises(ValueError, match=r"--max-queue must be 0 or more, got -1 @ ServeOptions"):
        ServeOptions(max_queue=-1)
    assert "'k'" not in repr(options) and "'<hidden>'" in repr(options)
