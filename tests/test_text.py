"""Stop strings and hold-back in streamed text."""

from __future__ import annotations

import time

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


class _Reference:
    """The obvious quadratic assembler: find each stop in the whole text, try every tail."""

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.text, self.shown, self.stopped = [s for s in stop if s], "", 0, False

    def push(self, piece: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.text += piece
        hits = [i for s in self.stop if (i := self.text.find(s)) >= 0]
        if hits:
            self.stopped, self.text = True, self.text[: min(hits)]
            end = len(self.text)
        else:
            tails = range(len(self.text), 0, -1)
            held = (
                0
                if final
                else next(
                    (n for n in tails if any(s.startswith(self.text[-n:]) for s in self.stop)), 0
                )
            )
            end = len(self.text) - held
        out, self.shown = self.text[self.shown : max(end, self.shown)], max(end, self.shown)
        return out


@given(
    st.lists(st.text(alphabet="ab", max_size=5), max_size=16),
    st.lists(st.text(alphabet="ab", min_size=1, max_size=6), max_size=4),
)
def test_each_push_shows_exactly_what_the_quadratic_reference_shows(
    pieces: list[str], stops: list[str]
) -> None:
    # a two-letter alphabet makes stop strings overlap themselves and each other (KMP's
    # fallbacks), where a matcher that forgot a partial match would show too much
    a, reference = TextAssembler(stops), _Reference(stops)
    for piece in pieces:
        assert a.push(piece) == reference.push(piece)
        assert a.stopped == reference.stopped
    assert a.flush() == reference.push("", final=True)
    assert a.text == reference.text


def test_self_overlapping_stop_strings_hold_back_and_match() -> None:
    a = TextAssembler(["aab", "abab"])
    assert a.push("aa") == ""  # "aa" begins "aab"
    assert a.push("a") == "a"  # "aaa": only the last "aa" may begin "aab"
    assert a.push("ba") == ""  # "aaaba" holds "aab" from index 1: cut there
    assert a.stopped and a.text == "a"


def test_long_stop_strings_cost_linear_time_per_piece() -> None:
    # Four 20,000-character stop strings over 2,000 small pieces, none of which ever begins one.
    # Trying every tail of the text against every stop string on each piece took about 8 s
    # here; one KMP pass over each piece takes milliseconds.
    stops = [c * 19_999 + "!" for c in "wxyz"]
    a = TextAssembler(stops)
    started = time.perf_counter()
    shown = "".join(a.push("abc ") for _ in range(2_000)) + a.flush()
    elapsed = time.perf_counter() - started
    assert shown == "abc " * 2_000 and not a.stopped
    # The worst case for hold-back: text that keeps matching most of a stop string.
    b = TextAssembler(["a" * 1023 + "b"] * 4)
    assert "".join(b.push("a") for _ in range(20_000)) == "a" * (20_000 - 1023)
    assert b.push("b") == "" and b.stopped and b.text == "a" * (20_000 - 1023)
    elapsed_total = time.perf_counter() - started
    assert elapsed < 1.0 and elapsed_total < 2.0, (elapsed, elapsed_total)


def test_one_stop_string_is_a_string_not_its_characters() -> None:
    assembler = TextAssembler("five")
    assert assembler.stop == ("five",)
    assembler.push(" four, f")
    assembler.push("ive, six")
    assert assembler.stopped and assembler.text == " four, "
