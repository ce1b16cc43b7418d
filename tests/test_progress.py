"""Progress: plain lines (round, elapsed, rate, ETA) off a terminal, a
tqdm bar on one, timed phase lines, and silence when disabled."""

import io

import pytest

from scaffold_jax import progress as progress_module
from scaffold_jax.progress import Progress


class _Clock:
    """A perf_counter that returns the times it is given."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(progress_module.time, "perf_counter", lambda: self.now)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_give_the_round_elapsed_rate_and_an_eta_without_one_off_costs(monkeypatch):
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    bar = Progress(10, "scaffold", stream=stream)  # a StringIO is no terminal: plain lines
    with bar.phase("compiling 2 rounds as one program"):
        clock.now = 30.0
    bar({"round": 0, "test_accuracy": 0.1})  # round 0: before the rounds, no line
    clock.now = 40.0  # the first block: its first execution and first checkpoint are slow
    bar({"round": 2, "test_accuracy": 0.5})
    bar({"round": 2, "test_accuracy": 0.5})  # no progress, no line
    clock.now = 42.0
    bar({"round": 4, "test_accuracy": 0.6})
    with bar.phase("writing a checkpoint"):  # a phase between two updates: not in the rate
        clock.now = 50.0
    clock.now = 56.0
    bar({"round": 10, "test_loss": 0.25})
    assert stream.getvalue().splitlines() == [
        "compiling 2 rounds as one program...",
        "compiling 2 rounds as one program: 30.0 s",
        # The first update: no rate yet (the first block's 10 s are not 5 s a round).
        "scaffold: round 2/10 (20%), 40.0 s elapsed, acc=0.5",
        # 2 rounds in 2 s since the first update: 1 round/s, 6 rounds to go.
        "scaffold: round 4/10 (40%), 42.0 s elapsed, 1 round/s, ETA 6.0 s, acc=0.6",
        "writing a checkpoint...",
        "writing a checkpoint: 8.0 s",
        "scaffold: round 10/10 (100%), 56.0 s elapsed, 1 round/s, ETA 0.0 s, loss=0.25",
    ]


def test_plain_lines_come_once_a_tenth_or_every_half_minute(monkeypatch):
    """A run that evaluates every round prints about ten lines, not one per record; a
    slow one still says something every PLAIN_LINE_SECONDS."""
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    bar = Progress(1000, "fig3", stream=stream)
    for r in range(1, 1001):
        clock.now = r * 0.01
        bar.update(r)
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == [
        "1/1000",
        *[f"{100 * t}/1000" for t in range(1, 11)],
    ]
    slow = io.StringIO()
    bar = Progress(1000, "slow", stream=slow)
    for r in range(1, 51):  # 50 rounds, 10 s each: 5% of the work in 500 s
        clock.now = 1000 + 10 * r
        bar.update(r)
    rounds = [int(line.split()[2].split("/")[0]) for line in slow.getvalue().splitlines()]
    assert rounds == [1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 37, 40, 43, 46, 49]


def test_the_last_line_comes_once_even_after_a_rebase_or_a_hair_short(monkeypatch):
    """A grid's work-weighted units can sum to a hair under the total, and the cell that
    finishes last may be counted (rebase) before its final block's update: the line at the
    total still comes, once (under load, reproduce table3 ended its lines at 220/240)."""
    clock = _Clock(monkeypatch)
    for moves in ([120.0, ("rebase", 240.0), 240.0], [120.0, 240.0 * (1 - 1e-12)]):
        stream = io.StringIO()
        bar = Progress(240, "table3", stream=stream)
        for i, move in enumerate(moves):
            clock.now = 100.0 + i  # within PLAIN_LINE_SECONDS: only a tenth or the end prints
            if isinstance(move, tuple):
                bar.rebase(move[1])
            else:
                bar.update(move)
        bar.update(bar.done)  # nothing new: no second last line
        lines = stream.getvalue().splitlines()
        assert [line.split()[2] for line in lines] == ["120/240", "240/240"], lines


def test_a_brief_progress_prints_only_the_phases_that_take_a_while(monkeypatch):
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    bar = Progress(4, "table3", stream=stream)
    bar.brief = True  # a grid's cells after the first
    with bar.phase("compiling the evaluation"):
        clock.now = 0.2
    with bar.phase("compiling 5 rounds as one program"):
        clock.now = 3.2
    assert stream.getvalue() == "compiling 5 rounds as one program: 3.0 s\n"


def test_a_resumed_run_counts_only_its_own_rounds_in_the_rate(monkeypatch):
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    bar = Progress(100, "scaffold", stream=stream)
    clock.now = 5.0
    bar.rebase(50)  # restored at round 50
    clock.now = 10.0
    bar.update(60)  # the resumed process's first block: no rate yet
    clock.now = 15.0
    bar.update(70)
    assert stream.getvalue() == (
        "scaffold: round 60/100 (60%), 10.0 s elapsed\n"
        "scaffold: round 70/100 (70%), 15.0 s elapsed, 2 round/s, ETA 15.0 s\n"
    )


def test_a_failed_phase_does_not_say_it_finished():
    stream = io.StringIO()
    bar = Progress(4, stream=stream)
    with pytest.raises(FileNotFoundError), bar.phase("loading cifar10"):
        raise FileNotFoundError("no data")
    assert stream.getvalue() == "loading cifar10...\n"


def test_a_terminal_gets_a_tqdm_bar_and_lines_above_it():
    pytest.importorskip("tqdm")
    stream = _Terminal()
    bar = Progress(4, "fedavg", stream=stream)
    assert not bar.plain
    bar.update(2, "acc=0.5")
    bar.write("a line")
    bar.update(4)
    bar.close()
    text = stream.getvalue()
    assert "a line\n" in text and "4/4" in text and "round/s" in text and "acc=0.5" in text


def test_disabled_progress_prints_nothing(capsys):
    bar = Progress(4, "fedavg", enabled=False)
    with bar.phase("loading"):
        pass
    bar.write("text")
    bar.update(2)
    bar.close()
    assert capsys.readouterr() == ("", "")
