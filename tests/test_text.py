"""Stop strings and hold-back in streamed text."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stagerun._text import TextAssembler


def test_no_stop_strings_shows_everything_at_once() -> None:
    a = TextAssembler()
    assert a.push("Hello") == "Hello"
    assert a.push(", world") == ", world"
    assert a.flush() == ""
    assert a.text == "Hello, world"


def test_stop_string_split_across_pieces_is_never_shown() -> None:
    a = TextAssembler(["\nUser:"])
    assert a.push("Hi there") == "Hi there"
    assert a.push("\nUs") == ""  # might be the start of the stop string
    assert a.push("er:") == ""
    assert a.stopped and a.text == "Hi there"


def test_a_stop_string_in_the_middle_keeps_what_precedes_it_and_cuts_what_follows() -> None:
    a = TextAssembler(["\nUser:"])
    pieces = ["The", " answer", " is 4", "2.\nUs", "er: and", " more", " text"]
    shown = [a.push(piece) for piece in pieces]
    assert shown == ["The", " answer", " is 4", "2.", "", "", ""]
    assert a.flush() == ""
    assert a.stopped and a.text == "The answer is 42."
    b = TextAssembler(["STOP"])
    assert b.push("keep this STOP drop this") == "keep this "  # one piece holding all three
    assert b.stopped and b.push(" and this") == "" and b.flush() == ""
    assert b.text == "keep this "


def test_held_back_text_is_released_when_it_cannot_stop() -> None:
    a = TextAssembler(["STOP"])
    assert a.push("ST") == ""
    assert a.push("AR") == "STAR"
    assert a.flush() == ""
    assert a.flush() == ""
    b = TextAssembler(["STOP"])
    assert b.push("abcST") == "abc"
    assert b.flush() == "ST"  # generation ended: the held text was not a stop after all


def test_earliest_of_several_stop_strings_wins() -> None:
    a = TextAssembler(["world", "lo"])
    a.push("Hello world")
    assert a.text == "Hel"


@given(
    st.lists(st.text(alphabet="abXY", max_size=4), max_size=12),
    st.lists(st.text(alphabet="abXY", min_size=1, max_size=3), max_size=3),
)
def test_shown_text_is_a_prefix_and_never_contains_a_stop(
    pieces: list[str], stops: list[str]
) -> None:
    a = TextAssembler(stops)
    shown = "".join(a.push(p) for p in pieces) + a.flush()
    full = "".join(pieces)
    assert shown == a.text
    assert full.startswith(shown)
    assert not any(s in shown for s in stops)
    if not a.stopped:
        assert shown == full
