"""Long work shows itself off a terminal: a log line each tenth of the work and one at the
end (a redirected log holds no carriage-return bars)."""

from __future__ import annotations

import logging

from calm_runtime.progress import LoggedProgress, progress


def test_off_a_terminal_progress_is_a_line_each_tenth(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    caplog.set_level(logging.INFO, logger="calm_runtime.progress")
    bar = progress(total=570, desc="cloze scoring", unit="question")
    assert isinstance(bar, LoggedProgress)
    for _ in range(57):
        bar.update(10)
    bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10, lines  # nine tenths on the way, and the end
    assert lines[0].startswith("cloze scoring: 60 of 570 questions (11%)")
    assert lines[-1].startswith("cloze scoring: 570 of 570 questions (100%)")


def test_wrapping_an_iterable_logs_and_yields_everything(caplog):
    caplog.set_level(logging.INFO, logger="calm_runtime.progress")
    items = list(progress(range(5), desc="batches", unit="batch", bar=False))
    assert items == [0, 1, 2, 3, 4]
    assert caplog.records[-1].getMessage().startswith("batches: 5 of 5 batches (100%)")


def test_quiet_hides_the_lines(caplog):
    caplog.set_level(logging.WARNING)
    bar = progress(total=3, desc="x", bar=False)
    bar.update(3)
    bar.close()
    assert not [r for r in caplog.records if r.name == "calm_runtime.progress"]
