"""The checks and conversions of message fields, and how a rejected value is shown.

Validators are attrs field validators: each raises ``ValueError`` naming the field
(``Decode.position``) and what it got, shown short (`_show`: a peer's value can be a
megabyte string or a map of 100,000 keys, and its error message stays small and cheap).
Converters accept what a Python caller naturally passes (a list or numpy array of token ids,
an int temperature) and nothing else, so a peer's bad value is never silently coerced.
"""

import itertools
import math
import numbers
import operator
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, Final, SupportsIndex, TypeAlias, cast

import attrs
import msgpack
import numpy as np
import numpy.typing as npt

_ID_LIMIT: Final = 2**63
_KEY_LIMIT: Final = 2**64
_TOKEN_LIMIT: Final = 2**31
_LIMIT_NAMES: Final = {_ID_LIMIT: "2**63", _KEY_LIMIT: "2**64", _TOKEN_LIMIT: "2**31"}

_Validator: TypeAlias = Callable[[Any, "attrs.Attribute[Any]", Any], None]


SHOWN_CHARS: Final = 60  # of a rejected value, in an error message: enough to recognise it


class _ShortRepr(reprlib.Repr):
    """`reprlib` that cuts what msgpack decodes to *before* building its repr.

    ``repr(value)[:60]`` would first build the whole repr of a megabyte header; `reprlib`
    already cuts str, tuples and lists, and here bytes, maps (without sorting their keys) and
    msgpack's ExtType too.
    """

    def repr_bytes(self, x: bytes, level: int) -> str:
        text = repr(x[: self.maxstring])
        return text if len(x) <= self.maxstring else text + "..."

    def repr_dict(self, x: dict[object, object], level: int) -> str:
        if not x or level <= 0:
            return "{}" if not x else "{...}"
        items = itertools.islice(x.items(), self.maxdict)
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in items]
        return "{" + ", ".join(pieces) + (", ...}" if len(x) > self.maxdict else "}")

    def repr_ExtType(self, x: msgpack.ExtType, level: int) -> str:  # named for reprlib
        return f"ExtType(code={x.code}, data={self.repr_bytes(x.data, level - 1)})"


_short_repr = _ShortRepr()
_short_repr.maxstring = _short_repr.maxother = SHOWN_CHARS
_short_repr.maxlevel = 3


def _show(value: object) -> str:
    """A short repr of a rejected value: what the peer sent, without flooding the error.

    Its cost does not grow with the value: a megabyte string or a map of 100,000 keys is cut
    before its repr is built.
    """
    text = _short_repr.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _where(instance: object, attribute: "attrs.Attribute[Any]") -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _int_in(limit: int) -> _Validator:
    label = _LIMIT_NAMES.get(limit, str(limit))

    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if type(value) is not int or not 0 <= value < limit:
            raise ValueError(
                f"{_where(instance, attribute)} must be an int in [0, {label}), got {_show(value)}."
            )

    return check


def _finite_float(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
    if type(value) is not float or not math.isfinite(value):
        raise ValueError(
            f"{_where(instance, attribute)} must be a finite float, got {_show(value)}."
        )


def _is_bool(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
    if type(value) is not bool:
        raise ValueError(f"{_where(instance, attribute)} must be a bool, got {_show(value)}.")


def _int_tuple(*, limit: int, max_len: int, non_empty: bool) -> _Validator:
    label = _LIMIT_NAMES.get(limit, str(limit))

    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        where = _where(instance, attribute)
        if type(value) is not tuple:
            raise ValueError(f"{where} must be a tuple of ints, got {_show(value)}.")
        if len(value) > max_len:
            raise ValueError(f"{where} holds {len(value)} items, more than the limit of {max_len}.")
        if not value:
            if non_empty:
                raise ValueError(f"{where} must not be empty.")
            return
        # C-speed checks first (this runs per token per hop); locate the culprit only on failure.
        if set(map(type, value)) == {int} and min(value) >= 0 and max(value) < limit:
            return
        index, bad = next(
            (i, v) for i, v in enumerate(value) if type(v) is not int or not 0 <= v < limit
        )
        raise ValueError(f"{where}[{index}] must be an int in [0, {label}), got {_show(bad)}.")

    return check


def _bounded_str(max_len: int) -> _Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if type(value) is not str:
            raise ValueError(f"{_where(instance, attribute)} must be a str, got {_show(value)}.")
        if len(value) > max_len:
            raise ValueError(
                f"{_where(instance, attribute)} is {len(value)} characters long, "
                f"more than the limit of {max_len}."
            )

    return check


def _as_tuple(value: Sequence[SupportsIndex] | npt.NDArray[np.integer[Any]]) -> tuple[int, ...]:
    """Accept a list or a numpy array where a tuple of ints is expected.

    numpy integers become ints (``tuple(np.array([1, 2]))`` holds ``np.int64``, which msgpack
    cannot pack). Nothing else is coerced: a bool, float or string token is left for the
    validator to reject, so a peer's bad value is never silently turned into a token.
    """
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if type(value) is list:
        value = tuple(value)
    if type(value) is not tuple or set(map(type, value)) <= {int}:
        return cast(tuple[int, ...], value)
    return tuple(
        operator.index(item)
        if isinstance(item, numbers.Integral) and not isinstance(item, bool)
        else item
        for item in value
    )


def _as_float(value: float) -> float:
    """Accept an int where a float is expected (``temperature=1``), but never a bool."""
    return float(value) if type(value) is int else value
