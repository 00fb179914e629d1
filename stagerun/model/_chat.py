"""Rendering chat messages with a model's Jinja chat template, the way Hugging Face does.

The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks`` on and
the ``loopcontrols`` extension, and gets the helpers templates in the wild call:
``raise_exception(message)``, ``strftime_now(format)`` and a ``tojson`` filter that keeps
non-ASCII text as is. A model file without a template gets ChatML.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from .._errors import StagerunError

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "render_chat"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(StagerunError, ValueError):
    """A chat template rejected the messages (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str,
    eos_token: str,
    **extra: Any,
) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) with a Jinja chat template.

    Args:
        template: the template source (``tokenizer.chat_template`` of a GGUF file).
        add_generation_prompt: end with the header of an assistant turn.
        bos_token: the text of the BOS token, for templates that write it.
        eos_token: the text of the EOS token.
        extra: further template variables (``tools``, ``date_string``, ...).

    Raises:
        ChatTemplateError: the template raised an exception or is not valid Jinja.
    """
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc
