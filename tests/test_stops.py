"""Stop strings on streamed text: never shown, not even in part; text is released when the
reply ends otherwise."""

from __future__ import annotations

from localchat.chat.stops import StopFilter


def _stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool, str]:
    flt = StopFilter(stops)
    shown = []
    for piece in pieces:
        text, stopped = flt.feed(piece)
        shown.append(text)
        if stopped:
            return shown, True, ""
    return shown, False, flt.flush()


def test_a_stop_split_across_pieces_is_never_shown() -> None:
    shown, stopped, _ = _stream(["Paris.", "\n", "Us", "er:", " next"], ("\nUser:",))
    assert stopped
    assert "".join(shown) == "Paris."
    assert shown[1] == ""  # "\n" might start the stop: held back


def test_held_back_text_is_released_when_it_is_not_a_stop() -> None:
    shown, stopped, rest = _stream(["a\n", "Use", "ful"], ("\nUser:",))
    assert not stopped and rest == ""
    assert "".join(shown) == "a\nUseful"
    shown, stopped, rest = _stream(["end\nUs"], ("\nUser:",))
    assert not stopped and "".join(shown) + rest == "end\nUs"


def test_the_earliest_of_several_stops_wins() -> None:
    shown, stopped, _ = _stream(["x\nSystem: y\nUser:"], ("\nUser:", "\nSystem:"))
    assert stopped and "".join(shown) == "x"


def test_no_stops_passes_everything_through() -> None:
    shown, stopped, rest = _stream(["a", "b\n"], ())
    assert shown == ["a", "b\n"] and not stopped and rest == ""
