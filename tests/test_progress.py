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


def test_plain_lines_give_the_round_elapsed_rate_and_an_eta_without_the_phases(monkeypatch):
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    bar = Progress(10, "scaffold", stream=stream)  # a StringIO is no terminal: plain lines
    with bar.phase("compiling 2 rounds as one program"):
        clock.now = 30.0
    bar({"round": 0, "test_accuracy": 0.1})  # round 0: before the rounds, no line
    clock.now = 32.0
    bar({"round": 2, "test_accuracy": 0.5})
    bar({"round": 2, "test_accuracy": 0.5})  # no progress, no line
    clock.now = 40.0
    bar({"round": 10, "test_loss": 0.25})
    assert stream.getvalue().splitlines() == [
        "compiling 2 rounds as one program...",
        "compiling 2 rounds as one program: 30.0 s",
        # 2 rounds in the 2 s outside the phase: 1 round/s, 8 rounds to go.
        "scaffold: round 2/10 (20%), 32.0 s elapsed, 1 round/s, ETA 8.0 s, acc=0.5",
        "scaffold: round 10/10 (100%), 40.0 s elapsed, 1 round/s, ETA 0.0 s, loss=0.25",
    ]


def test_a_resumed_run_counts_only_its_own_rounds_in_the_rate(monkeypatch):
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    bar = Progress(100, "scaffold", stream=stream)
    clock.now = 5.0
    bar.rebase(50)  # restored at round 50
    clock.now = 10.0
    bar.update(60)
    assert stream.getvalue() == (
        "scaffold: round 60/100 (60%), 10.0 s elapsed, 2 round/s, ETA 20.0 s\n"
    )


def test_a_failed_phase_does_not_say_it_finished():
    stream = io.StringIO()
    bar = Progress(4, stream=stream)
    with pytest.raises(FileNotFoundError), bar.phase("loading cifar10"):
        raise FileNotFoundError("no data")
    assert stream.getvalue() == "loading cifar10...\n"


def test_cells_are_one_plain_line_each_with_their_text(monkeypatch):
    clock = _Clock(monkeypatch)
    stream = io.StringIO()
    cells = Progress(4, "table3", unit="cell", stream=stream)
    cells.show()  # a bar only: nothing on a plain stream
    clock.now = 100.0
    cells.step("SGD E=1 s=0%: 12 rounds")
    assert stream.getvalue() == (
        "table3: cell 1/4 (25%), 1:40 elapsed, 0.01 cell/s, ETA 5:00, SGD E=1 s=0%: 12 rounds\n"
    )


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
    bar.step("a cell")
    bar.close()
    assert capsys.readouterr() == ("", "")
