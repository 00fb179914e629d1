"""Which values each `PipelineConfig` setting may take, one check per field.

`check_settings` refuses a value that is wrong whatever the other settings are, in one
sentence naming the field; `plan` (`_config`) checks how the settings fit together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

from .. import _proto
from .._decide._prefill import AdaptiveRamp, FixedChunks, ScheduleChunks, parse_chunk_policy
from ._policies import RecoveryPolicy, SpeculationConfig, SupervisionPolicy

__all__ = ["Mode", "check_settings"]

Mode = Literal["inproc", "processes"]


def _whole(least: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= least


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _number(least: float, *, above: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return v > least if above else v >= least

    return check


def _chunk_policy_ok(value: Any) -> bool:
    if isinstance(value, (FixedChunks, ScheduleChunks, AdaptiveRamp)):
        return True
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return False
    try:
        parse_chunk_policy(str(value))  # what `Pipeline` does with it
    except ValueError:
        return False
    return True


def _recovery_ok(value: Any) -> bool:
    if not isinstance(value, RecoveryPolicy):
        return False
    times = (value.timeout, value.backoff, value.max_backoff)
    return _whole(0)(value.max_breaks) and all(map(_number(0.0), times))


def _supervision_ok(value: Any) -> bool:
    if not isinstance(value, SupervisionPolicy):
        return False
    waits = (value.backoff, value.max_backoff, value.stable_after, value.probe_interval)
    deadlines = (value.probe_timeout, value.ready_timeout)
    return (
        all(map(_number(0.0), waits))
        and all(map(_number(0.0, above=True), deadlines))
        and _whole(1)(value.probe_failures)
    )


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _names(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _name_list(value: Any) -> bool:
    return isinstance(value, tuple) and all(map(_names, value))


# field -> (what it must be, its check); `plan` checks how the fields fit together.
_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "stages": ("must be at least 1", _whole(1)),
    "mode": (f"must be one of {', '.join(get_args(Mode))}", lambda v: v in get_args(Mode)),
    "host": ("must be a host name or address", _names),
    "threads": ("must be None or at least 1", _optional(_whole(1))),
    "wire_dtype": (
        f"must be one of {', '.join(_proto.ACTIVATION_DTYPES)}",
        lambda v: v in _proto.ACTIVATION_DTYPES,
    ),
    "capacity": ("must be at least 1 lane", _whole(1)),
    "prefill_chunk": (
        "must be 'adaptive', a size like 256 or a schedule like 128,256",
        _chunk_policy_ok,
    ),
    "prefill_credit": ("must be at least 1 chunk", _whole(1)),
    "hop_delay_ms": ("must not be negative (milliseconds)", _number(0.0)),
    "bandwidth_mbps": ("must be None or 0 or more Mbit/s (0: no cap)", _optional(_number(0.0))),
    "speculation": (
        "must be None or a SpeculationConfig",
        _optional(lambda v: isinstance(v, SpeculationConfig)),
    ),
    "transport": ("must be a transport plugin's name", _names),
    "transports": ("must be None or transport plugins' names", _optional(_name_list)),
    "backend": ("must be a backend plugin's name", _names),
    "backends": ("must be None or backend plugins' names", _optional(_name_list)),
    "device": ("must be None or a device name (cuda, cpu, ...)", _optional(_names)),
    "flash_attention": ("must be None, True or False", _optional(_is_bool)),
    "recovery": (
        "must be None or a RecoveryPolicy of no negative counts or times",
        _optional(_recovery_ok),
    ),
    "supervision": (
        "must be None or a SupervisionPolicy of positive deadlines and no negative waits",
        _optional(_supervision_ok),
    ),
    "reply_timeout": (
        "must be None or a positive number of seconds",
        _optional(_number(0.0, above=True)),
    ),
    "prefix_cache": ("must be True or False", _is_bool),
    "prefix_cache_mb": ("must not be negative (MiB)", _whole(0)),
    "chat_template": ("must be None or a template's text, not empty", _optional(_names)),
    "inline_compute_ms": ("must not be negative (milliseconds)", _number(0.0)),
}


def check_settings(config: object) -> None:
    """Refuse a setting of ``config`` (a `PipelineConfig`) that is wrong whatever the others
    are (`plan` checks the rest).

    Raises:
        ValueError: one sentence, ``what @ PipelineConfig.field``.
    """
    for name, (requirement, check) in _CHECKS.items():
        value = getattr(config, name)
        if not check(value):
            shown = (
                f"a template of {len(value)} characters" if name == "chat_template" else repr(value)
            )
            raise ValueError(f"{name} {requirement}, got {shown} @ PipelineConfig.{name}")
