"""Stop strings across token boundaries (StopMatcher in services/worker/engines/sim.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.worker.engines.sim import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Feed pieces until a stop; returns (emitted per feed, stopped, flush())."""
    matcher = StopMatcher(stops)
    emitted: list[str] = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            break
    return emitted, stopped, matcher.flush()


def test_no_stops_passes_everything_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed(" hello") == (" hello", False)
    assert matcher.feed("") == ("", False)
    assert matcher.feed(" ###") == (" ###", False)
    assert matcher.flush() == ""
    assert matcher.stopped is False


def test_empty_stop_strings_are_ignored() -> None:
    matcher = StopMatcher(["", ""])
    assert matcher.feed("abc") == ("abc", False)


def test_stop_inside_one_piece() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("hello END world") == ("hello ", True)
    assert matcher.stopped is True
    assert matcher.flush() == ""


def test_stop_at_the_start_of_a_piece() -> None:
    emitted, stopped, _ = run(["END"], [" a", "END"])
    assert emitted == [" a", ""]
    assert stopped


def test_stop_spanning_pieces() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)  # "ST" could start STOP: held
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("Pxyz") == ("", True)
    assert matcher.stopped


def test_held_text_released_when_it_turns_out_not_to_be_a_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("AR") == ("STAR", False)
    assert matcher.stopped is False


def test_partial_stop_is_never_emitted() -> None:
    stop = "<|end|>"
    emitted, stopped, _ = run([stop], ["x", "<", "|", "e", "n", "d", "|", ">", "tail"])
    assert stopped
    assert "".join(emitted) == "x"
    for chunk in emitted:
        assert "<" not in chunk


def test_flush_releases_held_text_at_the_end() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc S") == ("abc ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_overlapping_prefix() -> None:
    # "aab": after "aa" both a's may start the stop; the first is released once "aab" is seen at 1.
    emitted, stopped, _ = run(["aab"], ["aa", "ab"])
    assert stopped
    assert "".join(emitted) == "a"


def test_multiple_stops_earliest_wins() -> None:
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == ("hel", True)
    matcher = StopMatcher(["lo", "hell"])
    assert matcher.feed("hello") == ("", True)


def test_multiple_stops_hold_the_longest_partial() -> None:
    matcher = StopMatcher(["xyz", "yq"])
    assert matcher.feed("axy") == ("a", False)  # "xy" could start "xyz"
    assert matcher.feed("q") == ("x", True)  # "yq" completes first


# --- property ------------------------------------------------------------------------

alphabet = st.sampled_from("ab c")
pieces_st = st.lists(st.text(alphabet, max_size=5), max_size=12)
stop_st = st.text(alphabet, min_size=1, max_size=4)


@given(pieces=pieces_st, stop=stop_st)
def test_emitted_text_is_the_full_text_cut_at_the_first_stop(pieces: list[str], stop: str) -> None:
    full = "".join(pieces)
    matcher = StopMatcher([stop])
    out: list[str] = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        # Never emit anything that could be (part of) the stop string ahead of time.
        assert stop not in "".join(out)
        if stopped:
            break
    cut = full.find(stop)
    if cut >= 0:
        assert stopped
        assert "".join(out) == full[:cut]
    else:
        assert not stopped
        assert "".join(out) + matcher.flush() == full


@given(pieces=pieces_st, stop=stop_st)
def test_emitted_prefix_is_always_safe(pieces: list[str], stop: str) -> None:
    """What has been emitted so far is a prefix of the final answer, whatever comes next."""
    full = "".join(pieces)
    cut = full.find(stop)
    answer = full if cut < 0 else full[:cut]
    matcher = StopMatcher([stop])
    emitted = ""
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted += text
        assert answer.startswith(emitted)
        if stopped:
            break


@given(pieces=pieces_st, stops=st.lists(stop_st, min_size=1, max_size=3))
def test_multiple_stops_in_one_piece_cut_at_the_earliest(pieces: list[str], stops: list[str]) -> None:
    full = "".join(pieces)
    emitted, stopped, flushed = run(stops, [full])
    found = [i for i in (full.find(s) for s in stops) if i >= 0]
    if found:
        assert stopped
        assert emitted == [full[: min(found)]]
    else:
        assert not stopped
        assert emitted[0] + flushed == full
