"""Every message that travels between stages, and the cattrs converter that puts them on the wire.

Theory of operation
-------------------
A message is a frozen attrs value. Its validators run on construction, so *a message that exists
is valid*: ids, positions and keys are plain ``int`` (never ``bool``) in range, token lists are
tuples of token ids within the size limit, strings are bounded (the validators and converters
are in `_fields`). Building a bad message in Python raises ``TypeError``/``ValueError`` (a
programming error, caught by tests); decoding one from the wire goes through
:func:`structure_message`, which turns every such failure into a
:class:`~stagerun._errors.ProtocolError` naming the kind and the field.

The wire form of a message is its kind name plus a dict of its fields, produced by one cattrs
converter (``_wire``). The converter never coerces: its hooks for ``int``, ``float``, ``str`` and
``bool`` pass values through unchanged so the validators see exactly what the peer sent (cattrs'
default ``int("5")`` would happily accept a string position). Tuples of ints unstructure to
lists; lists coming back are turned into tuples by the fields' attrs converters (which also
accept numpy integers from Python callers, and nothing else). The structure hook of every attrs
class first checks that it got a map with exactly the expected keys, so a missing or unknown
field is reported by name instead of surfacing as a bare ``KeyError``.

Kind names are class variables (``Decode.kind == "decode"``); :data:`MESSAGE_TYPES` maps them
back to classes and :data:`CARRIES_ACTIVATIONS` lists the classes whose frames carry a payload.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, TypeAlias, cast

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn

from .._errors import ProtocolError
from ._fields import (
    _ID_LIMIT,
    _KEY_LIMIT,
    _TOKEN_LIMIT,
    _as_tuple,
    _bounded_str,
    _int_in,
    _int_tuple,
    _is_bool,
    _show,
)
from ._sampling_params import (
    MAX_PROMPT_TOP_LOGPROBS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    _as_floats,
)
from ._status import Status

PROTOCOL_VERSION: Final = 7  # 7: prefix blocks of 4 tokens (a name stands for 4 positions)

MAX_TOKENS_PER_MESSAGE: Final = 65536
MAX_WINDOW_IDS: Final = 64
PREFIX_BLOCK: Final = 4  # tokens per prefix block (see `_prefix`)
MAX_PREFIX_NAMES: Final = MAX_TOKENS_PER_MESSAGE // PREFIX_BLOCK  # block names per message
MAX_ERROR_MESSAGE: Final = 4096

_ID = _int_in(_ID_LIMIT)
_TOKENS = _int_tuple(limit=_TOKEN_LIMIT, max_len=MAX_TOKENS_PER_MESSAGE, non_empty=True)
_MAYBE_TOKENS = _int_tuple(limit=_TOKEN_LIMIT, max_len=MAX_TOKENS_PER_MESSAGE, non_empty=False)
_WINDOW_IDS = _int_tuple(limit=_ID_LIMIT, max_len=MAX_WINDOW_IDS, non_empty=False)
_PREFIX_NAMES = _int_tuple(limit=_KEY_LIMIT, max_len=MAX_PREFIX_NAMES, non_empty=False)


@attrs.frozen
class StageStats:
    """Timings a reply carries upstream; each stage adds its own with :meth:`merge`.

    The first five fields are sums over the stages. The others describe one stage each, for
    prefill chunk planning: ``slowest_*`` the stage with the slowest compute per token (its
    compute time, token count and index), ``edge_*`` the hop with the largest forward write +
    downstream wait (the write, the wait and the index of the stage that sent it). Every
    non-final prefill chunk's ``Ack`` carries them for the whole chain below stage 0.
    """

    compute_us: int = attrs.field(default=0, validator=_ID)
    forward_write_us: int = attrs.field(default=0, validator=_ID)
    downstream_wait_us: int = attrs.field(default=0, validator=_ID)
    stage_count: int = attrs.field(default=0, validator=_ID)
    token_count: int = attrs.field(default=0, validator=_ID)
    slowest_compute_us: int = attrs.field(default=0, validator=_ID)
    slowest_tokens: int = attrs.field(default=0, validator=_ID)
    slowest_stage: int = attrs.field(default=0, validator=_ID)
    edge_write_us: int = attrs.field(default=0, validator=_ID)
    edge_wait_us: int = attrs.field(default=0, validator=_ID)
    edge_stage: int = attrs.field(default=0, validator=_ID)

    def merge(self, other: "StageStats") -> "StageStats":
        """Sum the totals; keep the slower stage and the costlier edge of the two."""
        mine_rate = self.slowest_compute_us / self.slowest_tokens if self.slowest_tokens else -1.0
        other_rate = (
            other.slowest_compute_us / other.slowest_tokens if other.slowest_tokens else -1.0
        )
        slow = self if mine_rate >= other_rate else other
        edge = (
            self
            if self.edge_write_us + self.edge_wait_us >= other.edge_write_us + other.edge_wait_us
            else other
        )
        return StageStats(
            compute_us=self.compute_us + other.compute_us,
            forward_write_us=self.forward_write_us + other.forward_write_us,
            downstream_wait_us=self.downstream_wait_us + other.downstream_wait_us,
            stage_count=self.stage_count + other.stage_count,
            token_count=self.token_count + other.token_count,
            slowest_compute_us=slow.slowest_compute_us,
            slowest_tokens=slow.slowest_tokens,
            slowest_stage=slow.slowest_stage,
            edge_write_us=edge.edge_write_us,
            edge_wait_us=edge.edge_wait_us,
            edge_stage=edge.edge_stage,
        )


_NO_STATS: Final = StageStats()


# --- requests: stage 0 -> downstream ------------------------------------------------------------


@attrs.frozen
class Configure:
    """Open a request on a chain and bind it to the return connection parked under ``return_key``.

    ``prefix`` names the prefix blocks stage 0 would like the request to start from
    (`stagerun._proto._prefix`): each stage restores the longest run of them it holds, and
    the ``Ack`` says how many positions every stage below restored (``Ack.cached``).
    """

    kind: ClassVar[str] = "configure"
    request_id: int = attrs.field(validator=_ID)
    return_key: int = attrs.field(validator=_int_in(_KEY_LIMIT))
    prompt_len: int = attrs.field(validator=_ID)
    sampling: SamplingParams = attrs.field(
        default=SamplingParams(), validator=attrs.validators.instance_of(SamplingParams)
    )
    prefix: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple, validator=_PREFIX_NAMES)


@attrs.frozen
class Prefill:
    """One chunk of the prompt starting at ``position``; ``predict`` asks for the next token."""

    kind: ClassVar[str] = "prefill"
    request_id: int = attrs.field(validator=_ID)
    chunk_index: int = attrs.field(validator=_ID)
    position: int = attrs.field(validator=_ID)
    tokens: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_TOKENS)
    predict: bool = attrs.field(validator=_is_bool)


@attrs.frozen
class Decode:
    """Plain decode: the tokens at ``position`` (usually one); the reply is ``Predictions``."""

    kind: ClassVar[str] = "decode"
    request_id: int = attrs.field(validator=_ID)
    position: int = attrs.field(validator=_ID)
    tokens: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_TOKENS)


@attrs.frozen
class Verify:
    """A speculative verify window: base token and drafts at ``position``, tagged with its epoch."""

    kind: ClassVar[str] = "verify"
    request_id: int = attrs.field(validator=_ID)
    window_id: int = attrs.field(validator=_ID)
    epoch: int = attrs.field(validator=_ID)
    position: int = attrs.field(validator=_ID)
    tokens: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_TOKENS)


@attrs.frozen
class Cancel:
    """Drop the listed windows (stale since ``epoch``) from every stage's queue; no reply."""

    kind: ClassVar[str] = "cancel"
    request_id: int = attrs.field(validator=_ID)
    epoch: int = attrs.field(validator=_ID)
    window_ids: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_WINDOW_IDS)


@attrs.frozen
class Trim:
    """Cut every stage's KV cache for the request back to ``position`` tokens."""

    kind: ClassVar[str] = "trim"
    request_id: int = attrs.field(validator=_ID)
    position: int = attrs.field(validator=_ID)


@attrs.frozen
class Remember:
    """The request's first ``16 * len(prefix)`` positions are these blocks: keep them (no reply).

    Each stage copies the blocks it does not hold yet from the request's cache into its
    prefix cache, as far as its cache reaches, and passes the message on.
    """

    kind: ClassVar[str] = "remember"
    request_id: int = attrs.field(validator=_ID)
    prefix: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_PREFIX_NAMES)


@attrs.frozen
class Probe:
    """Ask the stage at the other end of this connection for its `Status` (not forwarded).

    ``request_id``: the request whose recent work on the stage the `Status` lists (0: none).
    """

    kind: ClassVar[str] = "probe"
    request_id: int = attrs.field(validator=_ID)


@attrs.frozen
class Stop:
    """End the request and free its sessions on every stage."""

    kind: ClassVar[str] = "stop"
    request_id: int = attrs.field(validator=_ID)


# --- replies ------------------------------------------------------------------------------------


@attrs.frozen
class Ack:
    """Hop-by-hop acknowledgement carrying the merged stats of every stage below.

    ``cached``: for a ``Configure``, the positions of the request's prefix that this stage
    and every stage below it restored from their prefix caches (the least of them).
    """

    kind: ClassVar[str] = "ack"
    request_id: int = attrs.field(validator=_ID)
    stats: StageStats = attrs.field(
        default=_NO_STATS, validator=attrs.validators.instance_of(StageStats)
    )
    cached: int = attrs.field(default=0, validator=_ID)


@attrs.frozen
class Predictions:
    """Tokens the last stage predicted for the window (or decode step) starting at ``position``.

    For a request that asked for log-probabilities (``SamplingParams.logprobs`` n >= 0),
    ``logprobs`` holds each row's sampled token's, and ``top_ids``/``top_logprobs`` the n
    most likely tokens of each row, row after row (``n * len(tokens)`` of each).
    """

    kind: ClassVar[str] = "predictions"
    request_id: int = attrs.field(validator=_ID)
    window_id: int = attrs.field(validator=_ID)
    position: int = attrs.field(validator=_ID)
    tokens: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_MAYBE_TOKENS)
    stats: StageStats = attrs.field(
        default=_NO_STATS, validator=attrs.validators.instance_of(StageStats)
    )
    logprobs: tuple[float, ...] = attrs.field(default=(), converter=_as_floats)
    top_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple, validator=_MAYBE_TOKENS)
    top_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_as_floats)
    prompt_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_as_floats)
    prompt_top_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_MAYBE_TOKENS
    )
    prompt_top_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_as_floats)

    @prompt_logprobs.validator
    def _check_prompt(self, attribute: "attrs.Attribute[Any]", value: object) -> None:
        _check_logprob_rows(self, attribute, value, len(value) if type(value) is tuple else 0)
        if len(value) > MAX_TOKENS_PER_MESSAGE:  # type: ignore[arg-type]
            raise ValueError("Predictions.prompt_logprobs holds more than a message's tokens.")

    @prompt_top_logprobs.validator
    def _check_prompt_top(self, attribute: "attrs.Attribute[Any]", value: object) -> None:
        _check_logprob_rows(self, attribute, value, len(self.prompt_top_ids))
        rows = len(self.prompt_logprobs)
        if self.prompt_top_ids and (
            not rows
            or len(self.prompt_top_ids) % rows
            or len(self.prompt_top_ids) > MAX_PROMPT_TOP_LOGPROBS * rows
        ):
            raise ValueError(
                f"Predictions.prompt_top_ids must hold the same number of ids (at most "
                f"{MAX_PROMPT_TOP_LOGPROBS}) for each of the {rows} prompt tokens."
            )

    @logprobs.validator
    def _check_logprobs(self, attribute: "attrs.Attribute[Any]", value: object) -> None:
        _check_logprob_rows(self, attribute, value, len(self.tokens))

    @top_logprobs.validator
    def _check_top(self, attribute: "attrs.Attribute[Any]", value: object) -> None:
        _check_logprob_rows(self, attribute, value, len(self.top_ids))
        if self.top_ids and (not self.tokens or len(self.top_ids) % len(self.tokens)):
            raise ValueError(
                f"Predictions.top_ids must hold the same number of ids for each of the "
                f"{len(self.tokens)} rows, got {len(self.top_ids)}."
            )
        if self.top_ids and len(self.top_ids) > MAX_TOP_LOGPROBS * len(self.tokens):
            raise ValueError(f"Predictions.top_ids holds more than {MAX_TOP_LOGPROBS} per row.")


def _check_logprob_rows(
    instance: object, attribute: "attrs.Attribute[Any]", value: object, length: int
) -> None:
    """``value`` is empty, or ``length`` log-probabilities (finite floats, at most 0)."""
    if type(value) is not tuple or (value and len(value) != length):
        raise ValueError(
            f"Predictions.{attribute.name} must be empty or hold {length} floats, got "
            f"{_show(value)}."
        )
    for v in value:
        if type(v) is not float or not -math.inf < v <= 0.0:
            raise ValueError(
                f"Predictions.{attribute.name} must hold log-probabilities (finite, at most "
                f"0), got {_show(v)}."
            )


@attrs.frozen
class Cancelled:
    """The last stage's answer to a ``Cancel``: these windows will never get ``Predictions``.

    Sent on the return connection after every reply the last stage did send for them, so
    stage 0 can account for each window it opened without waiting for any.
    """

    kind: ClassVar[str] = "cancelled"
    request_id: int = attrs.field(validator=_ID)
    epoch: int = attrs.field(validator=_ID)
    window_ids: tuple[int, ...] = attrs.field(converter=_as_tuple, validator=_WINDOW_IDS)


@attrs.frozen
class Error:
    """A stage could not carry out a request; ``message`` is one plain sentence for the user."""

    kind: ClassVar[str] = "error"
    request_id: int = attrs.field(validator=_ID)
    stage_index: int = attrs.field(validator=_ID)
    message: str = attrs.field(validator=_bounded_str(MAX_ERROR_MESSAGE))


Message: TypeAlias = (
    Configure
    | Prefill
    | Decode
    | Verify
    | Cancel
    | Trim
    | Remember
    | Probe
    | Stop
    | Ack
    | Predictions
    | Cancelled
    | Error
    | Status
)
"""Any message a frame can carry."""

ActivationMessage: TypeAlias = Prefill | Decode | Verify
"""The messages whose frames carry an activation payload (one row per token)."""

MESSAGE_TYPES: Final[Mapping[str, type[Message]]] = {
    cls.kind: cls
    for cls in (
        Configure,
        Prefill,
        Decode,
        Verify,
        Cancel,
        Trim,
        Remember,
        Probe,
        Stop,
        Ack,
        Predictions,
        Cancelled,
        Error,
        Status,
    )
}
CARRIES_ACTIVATIONS: Final[frozenset[type[Message]]] = frozenset({Prefill, Decode, Verify})
"""The message classes whose frames carry activations (``isinstance(m, ActivationMessage)``)."""


# --- the wire converter -------------------------------------------------------------------------


def _passthrough(value: object, _type: object) -> object:
    return value


def _structure_hook(cls: type[Any]) -> Callable[[object, object], object]:
    """Wrap cattrs' generated dict -> class function with an exact key check."""
    inner = make_dict_structure_fn(cls, _wire, _cattrs_prefer_attrib_converters=True)
    names = frozenset(field.name for field in attrs.fields(cls))
    label = cls.__name__

    def structure(value: object, _type: object) -> object:
        if type(value) is not dict:
            raise ValueError(f"{label} fields must be a map, got {_show(value)}.")
        if value.keys() != names:
            missing = sorted(names - value.keys())
            if missing:
                raise ValueError(f"{label} is missing field {missing[0]!r}.")
            extra = next(key for key in value if key not in names)
            raise ValueError(f"{label} has unknown field {_show(extra)}.")
        return inner(value, cls)

    return structure


_wire = cattrs.Converter(detailed_validation=False, prefer_attrib_converters=True)
for _primitive in (int, float, str, bool):
    _wire.register_structure_hook(_primitive, _passthrough)
_wire.register_unstructure_hook_func(lambda type_: type_ == tuple[int, ...], list)
_wire.register_structure_hook_factory(attrs.has, _structure_hook)

_UNSTRUCTURE: Final = {cls: _wire.get_unstructure_hook(cls) for cls in MESSAGE_TYPES.values()}
_STRUCTURE: Final = {
    kind: (cls, _wire.get_structure_hook(cls)) for kind, cls in MESSAGE_TYPES.items()
}


def unstructure_message(message: Message) -> dict[str, Any]:
    """The wire fields of ``message`` (a msgpack-ready dict; its kind is ``message.kind``)."""
    return cast(dict[str, Any], _UNSTRUCTURE[type(message)](message))


def structure_message(kind: object, fields: object) -> Message:
    """Build the message of ``kind`` from wire ``fields``.

    Raises:
        ProtocolError: the kind is unknown, or the fields are missing, extra, of the wrong type
            or out of range.
    """
    entry = _STRUCTURE.get(kind) if type(kind) is str else None
    if entry is None:
        raise ProtocolError(
            f"unknown message kind {_show(kind)}; expected one of {', '.join(MESSAGE_TYPES)}."
        )
    cls, hook = entry
    try:
        return cast(Message, hook(fields, cls))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad {kind} message: {exc}") from exc
