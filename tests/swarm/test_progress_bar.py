"""The terminal progress display: pure formatting, redraw on a TTY, plain lines elsewhere."""

from __future__ import annotations

import io

from swarm.progress_bar import ProgressBar, format_bar, human_bytes

FIELDS = [("loss", "0.500")]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_format_bar() -> None:
    assert format_bar(0, 100, []) == "[--------------------]   0%"
    assert format_bar(35, 100, FIELDS) == "[#######-------------]  35%  loss 0.500"
    assert format_bar(250, 100, []).startswith("[####################] 100%")  # clamped
    assert format_bar(5, 0, []).startswith("[--------------------]   0%")


def test_tty_redraws_one_line_in_place_at_most_every_interval() -> None:
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(100, stream=out, tty=True, redraw_seconds=0.1, clock=clock)
    bar.update(10, [("loss", "a long value")])
    bar.update(20, FIELDS)  # too soon: not drawn
    clock.now = 0.2
    bar.update(30, FIELDS)
    bar.close(100, FIELDS)
    text = out.getvalue()
    assert "\n" not in text[:-1] and text.endswith("\n")
    frames = text[:-1].split("\r")[1:]
    assert [f.split("%")[0][-3:] for f in frames] == [" 10", " 30", "100"]
    assert len(frames[1]) == len(frames[0])  # padded: no tail of the longer line remains


def test_plain_output_prints_a_line_per_tenth_and_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(100, stream=out, tty=False, plain_seconds=30.0, clock=clock)
    for done in range(0, 96):
        bar.update(done, FIELDS)
    clock.now = 31.0
    bar.update(96, FIELDS)  # same tenth, but 30 s passed
    bar.close(100, FIELDS)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    shown = [int(line.split("%")[0][-3:]) for line in lines]
    assert shown == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 96, 100]


def test_write_puts_text_above_the_bar() -> None:
    out = io.StringIO()
    bar = ProgressBar(10, stream=out, tty=True)
    bar.update(5, [])
    bar.write("hello")
    assert out.getvalue().endswith("\rhello\n")


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 999, 1500, 74_700_000, 3e12)] == [
        "0 B",
        "999 B",
        "1.5 kB",
        "74.7 MB",
        "3000.0 GB",
    ]
