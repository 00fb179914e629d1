"""How nursery exception groups are read: one failure, the first leaf, the first assertion."""

from __future__ import annotations

import pytest

from stagerun._errors import LaneError, StageError
from stagerun._util import first_leaf, one_failure, only_of
from stagerun.testing._conformance._common import _first_assertion

KINDS = (LaneError, StageError)


def _nested() -> tuple[BaseExceptionGroup[BaseException], list[BaseException]]:
    a, b, c = LaneError("a"), StageError("b"), LaneError("c")
    group = BaseExceptionGroup("top", [BaseExceptionGroup("left", [a, b]), c])
    return group, [a, b, c]


def test_first_leaf_follows_the_groups_order() -> None:
    group, (a, _, _) = _nested()
    assert first_leaf(group) is a
    plain = ValueError("x")
    assert first_leaf(plain) is plain


@pytest.mark.parametrize(
    ("extra", "found"),
    [
        (None, True),  # every leaf a lane or stage failure: the first stands for the group
        (ValueError("a bug"), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_only_of_needs_every_leaf_to_be_of_the_kinds(
    extra: BaseException | None, found: bool
) -> None:
    group, leaves = _nested()
    if extra is not None:
        group = BaseExceptionGroup("with more", [group, extra])
    assert (only_of(group, KINDS) is leaves[0]) is found
    if not found:
        assert only_of(group, KINDS) is None


def test_one_failure_raises_the_first_leaf_from_the_group() -> None:
    group, (a, _, _) = _nested()
    with pytest.raises(LaneError) as caught, one_failure(KINDS):
        raise group
    assert caught.value is a and caught.value.__cause__ is group
    mixed = BaseExceptionGroup("mixed", [LaneError("x"), ValueError("y")])
    with pytest.raises(BaseExceptionGroup) as still, one_failure(KINDS):
        raise mixed
    assert still.value is mixed


def test_the_first_assertion_of_a_group_in_order() -> None:
    first, second = AssertionError("first"), AssertionError("second")
    group = ExceptionGroup("g", [ValueError("v"), ExceptionGroup("h", [first]), second])
    assert _first_assertion(group) is first
    assert _first_assertion(second) is second
    assert _first_assertion(ExceptionGroup("none", [ValueError("v")])) is None
    assert _first_assertion(ValueError("v")) is None
