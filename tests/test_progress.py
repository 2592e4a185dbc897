"""Progress of long work: a bar on a terminal, plain lines in a log."""

from __future__ import annotations

import io

from tqdm.std import tqdm

from limelight.progress import PlainProgress, progress_bar


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_at_the_start_at_most_one_per_interval_and_one_at_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    bar = progress_bar(
        total=8200, desc="shapley labels", unit="text", file=out, interval_s=30, clock=clock
    )
    assert isinstance(bar, PlainProgress)
    for _ in range(10):  # ten steps within the first interval: no line
        clock.now += 1
        bar.update(100)
    clock.now = 185.0
    bar.update(1310)  # 2,310 done after 3:05
    clock.now = 190.0
    bar.update(10)  # 5 s later: within the interval
    clock.now = 600.0
    bar.update(8200 - bar.n)
    bar.close()
    bar.close()  # closing twice prints nothing more
    lines = out.getvalue().splitlines()
    assert lines == [
        "shapley labels: 0 of 8,200 texts (0 %), 0:00 elapsed",
        "shapley labels: 2,310 of 8,200 texts (28 %), 3:05 elapsed, about 8 minutes left",
        "shapley labels: 8,200 of 8,200 texts (100 %), 10:00 elapsed",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_the_percentage_is_floored_until_the_work_is_done() -> None:
    out, clock = io.StringIO(), Clock()
    bar = progress_bar(total=321, desc="training", unit="batch", file=out, clock=clock)
    clock.now = 100.0
    bar.update(320)
    bar.update(1)
    bar.close()
    assert [line.split(", ")[0] for line in out.getvalue().splitlines()] == [
        "training: 0 of 321 batches (0 %)",
        "training: 320 of 321 batches (99 %)",
        "training: 321 of 321 batches (100 %)",
    ]


def test_the_end_line_is_not_repeated_and_a_new_stage_gets_its_own_line() -> None:
    out, clock = io.StringIO(), Clock()
    with progress_bar(total=4, desc="eval", unit="expl", file=out, clock=clock) as bar:
        bar.set_description("normxlogit")
        clock.now = 2.0
        bar.update(2)
        bar.set_postfix(loss="0.125")
        bar.set_description("distilled")
        bar.update(2)
    assert out.getvalue().splitlines() == [
        "eval: 0 of 4 explanations (0 %), 0:00 elapsed",
        "normxlogit: 2 of 4 explanations (50 %), 0:02 elapsed, less than a minute left",
        "distilled: 4 of 4 explanations (100 %), 0:02 elapsed, loss=0.125",
    ]


def test_an_iterable_is_counted_and_work_without_a_total_reads_as_a_count() -> None:
    out = io.StringIO()
    items = list(progress_bar(["a", "b", "c"], desc="calibrating heads", unit="text", file=out))
    assert items == ["a", "b", "c"]
    assert out.getvalue().splitlines()[-1].startswith("calibrating heads: 3 of 3 texts (100 %)")
    out = io.StringIO()
    with progress_bar(desc="fit", unit="batch", file=out) as bar:
        bar.update(3)
    assert out.getvalue().splitlines()[-1].startswith("fit: 3 batches, 0:00 elapsed")


def test_a_terminal_gets_tqdm_and_disabled_progress_prints_nothing() -> None:
    out = io.StringIO()
    drawn = progress_bar(total=3, desc="x", file=out, tty=True)
    assert isinstance(drawn, tqdm)
    drawn.close()
    quiet = io.StringIO()
    with progress_bar(total=3, desc="x", file=quiet, enabled=False) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""


def test_one_of_a_unit_is_said_in_the_singular() -> None:
    """`explain: 1 texts` read wrong: one text, one batch, one item; the total sets the noun
    of "N of M"."""
    out = io.StringIO()
    with progress_bar(desc="explain", unit="text", file=out) as bar:
        bar.update(1)
    assert out.getvalue().splitlines() == [
        "explain: 0 texts, 0:00 elapsed",
        "explain: 1 text, 0:00 elapsed",
    ]
    out = io.StringIO()
    with progress_bar(total=1, desc="fit", unit="batch", file=out) as bar:
        bar.update(1)
    assert [line.split(", ")[0] for line in out.getvalue().splitlines()] == [
        "fit: 0 of 1 batch (0 %)",
        "fit: 1 of 1 batch (100 %)",
    ]
    out = io.StringIO()
    with progress_bar(desc="x", file=out) as bar:  # tqdm's own unit, "it"
        bar.update(1)
        bar.update(1)
    assert [line.split(", ")[0] for line in out.getvalue().splitlines()] == [
        "x: 0 items",
        "x: 2 items",
    ]
    assert PlainProgress(desc="x", file=io.StringIO()).line().startswith("x: 0 items")
