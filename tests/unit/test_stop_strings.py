"""frontend/stop.py's StopStringMatcher on its own: text fed in arbitrary deltas comes out as the reference says
(everything before the earliest stop string, or all of it), every emitted piece is a prefix of that, and no part of a
stop string is ever shown before it is known not to be one."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from shuttle.frontend.stop import StopStringMatcher


def reference(text: str, stops: list[str], include_stop: bool, search_from: int = 0) -> tuple[str, bool]:
    """The whole output for `text`: cut at the earliest stop string starting at or after `search_from`."""
    hits = [(i, s) for s in stops if (i := text.find(s, search_from)) >= 0]
    if not hits:
        return text, False
    index, stop = min(hits)
    return text[:index] + (stop if include_stop else ""), True


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[str]:
    pieces = [matcher.feed(d) for d in deltas]
    return pieces + [matcher.flush()]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def test_a_stop_string_across_three_deltas_is_never_shown():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello S") == "Hello "
    assert m.feed("T") == ""
    assert m.feed("OP and more") == ""
    assert m.stopped and m.flush() == ""


def test_a_false_start_is_released_when_it_stops_matching():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ""
    assert m.feed("ART") == "START"
    assert not m.stopped


def test_held_text_is_released_at_the_end_of_the_output():
    m = StopStringMatcher(["</s>"])
    assert m.feed("done </") == "done "
    assert m.flush() == "</"


def test_include_stop_emits_the_stop_string_itself():
    m = StopStringMatcher(["\n\n"], include_stop=True)
    assert m.feed("a\n") == "a"
    assert m.feed("\nb") == "\n\n"
    assert m.stopped and m.feed("more") == ""


def test_the_earliest_stop_wins_over_the_first_listed():
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("hello world") == "hel"


def test_protected_text_is_never_part_of_a_stop_string():
    """min_tokens: a stop string that starts inside the protected text does not count, even if it ends after it."""
    m = StopStringMatcher(["ab"], protected=True)
    assert m.feed("xa") == "xa"  # all text is protected until protect() is called
    m.protect(2)
    assert m.feed("b") == "b"  # "ab" starts at 1, inside the protected text
    assert m.feed("ab") == ""
    assert m.stopped and m.released == 3


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert feed_all(m, ["a", "b", ""]) == ["a", "b", "", ""]


ALPHABET = "ab\n<>"


@settings(max_examples=400, deadline=None)
@given(text=st.text(ALPHABET, max_size=30), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10), include_stop=st.booleans())
# found by this test in a run of the suite: ">" complete in "<<>" was taken while "<><", which starts earlier, could
# (and did) still complete
@example(text="<<><", stops=[">", "<><"], cuts=[3], include_stop=False)
def test_any_split_of_the_text_gives_the_reference_output(text, stops, cuts, include_stop):
    want, stopped = reference(text, stops, include_stop)
    m = StopStringMatcher(stops, include_stop=include_stop)
    pieces = feed_all(m, split(text, cuts))
    assert "".join(pieces) == want
    assert m.stopped == stopped
    shown = ""
    for piece in pieces:
        shown += piece
        assert want.startswith(shown)  # nothing shown is ever taken back


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=30), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
       max_size=3), cuts=st.lists(st.integers(0, 30), max_size=10), protected_len=st.integers(0, 30))
def test_protection_moves_the_earliest_start_of_a_stop_string(text, stops, cuts, protected_len):
    protected_len = min(protected_len, len(text))
    want, _ = reference(text, stops, False, search_from=protected_len)
    m = StopStringMatcher(stops, protected=True)
    if protected_len == 0:
        m.protect(0)
    pieces = []
    fed = 0
    for delta in split(text, [*cuts, protected_len]):
        pieces.append(m.feed(delta))
        fed += len(delta)
        if fed == protected_len:
            m.protect(protected_len)
    pieces.append(m.flush())
    assert "".join(pieces) == want


def test_a_stop_string_that_starts_earlier_wins_over_one_complete_first():
    """">" is complete in "<<>", but "<><" starts before it and completes with the next delta: it ends the output
    there, as it would had the text come at once; at the end of the output a held complete stop string still
    counts."""
    m = StopStringMatcher([">", "<><"])
    assert m.feed("<<>") == "<" and not m.stopped
    assert m.feed("<") == "" and m.stopped and m.matched == "<><"
    m = StopStringMatcher([">", "<><"])
    assert m.feed("<<>") == "<" and m.flush() == "<" and m.stopped and m.matched == ">"
