"""Progress that reaches a log: plain lines when stderr is a file, nothing for a short phase."""

import io

from megabase.data.progress import progress, tracked


def test_lines_when_not_a_terminal():
    log = io.StringIO()
    with progress(4, "model", unit="window", every_s=0, stream=log) as bar:
        for _ in range(3):
            bar.update(1, bases=65_536)
    lines = log.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("megabase: model: 1/4 windows (25%), ")
    assert "bases/s" in lines[0] and "ETA" in lines[0]
    assert lines[2].startswith("megabase: model: 3/4 windows (75%)")
    assert lines[3].startswith("megabase: model: 3 windows done in ")


def test_a_short_phase_writes_nothing():
    log = io.StringIO()
    with progress(4, "model", unit="window", every_s=3600, stream=log) as bar:
        bar.update(4)
    with progress(4, "model", enabled=False, every_s=0, stream=log) as bar:
        bar.update(4)
    assert log.getvalue() == ""


def test_unknown_total_and_the_period_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("MEGABASE_PROGRESS_EVERY_S", "0")
    assert list(tracked(iter("abc"), "reading", unit="record")) == ["a", "b", "c"]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("megabase: reading: 1 records, ") and "ETA" not in err[0]
    assert err[-1].startswith("megabase: reading: 3 records done in ")


def test_a_note_ends_each_line_and_the_latest_wins():
    import io

    from megabase.data.progress import progress

    stream = io.StringIO()
    with progress(3, "rl", unit="step", every_s=0, stream=stream) as bar:
        bar.update(1, note="reward 0.10")
        bar.update(1)
        bar.update(1, note="reward 0.30")
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(", reward 0.10") and lines[1].endswith(", reward 0.10")
    assert lines[2].endswith(", reward 0.30") and lines[3].startswith("megabase: rl: 3 steps done")


def test_a_caller_that_knows_the_time_left_gives_the_eta():
    """Training under the sequence-length warm-up: its first steps are the cheapest, so the mean
    rate would promise too early an end; the trainer passes its own estimate (or none)."""
    log = io.StringIO()
    with progress(10, "train", unit="step", every_s=0, stream=log) as bar:
        bar.eta = lambda: 3725.0
        bar.update(1)
        bar.eta = lambda: None
        bar.update(1)
    lines = log.getvalue().splitlines()
    assert ", ETA 1 h 2 min" in lines[0] and "ETA" not in lines[1]
