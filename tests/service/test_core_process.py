"""The core process's restart budget and exit wording (pure logic; the real deaths are in
tests/service/engine/test_engine_process.py)."""

from __future__ import annotations

import pytest

from service.core_process import RestartWindow, exit_cause

pytestmark = pytest.mark.unit


def test_restart_window_gives_up_past_the_allowed_exits_within_the_window() -> None:
    window = RestartWindow(allowed=3, seconds=300.0)
    assert [window.give_up(t) for t in (0.0, 10.0, 20.0)] == [None, None, None]
    reason = window.give_up(30.0)
    assert reason == "the engine core died 4 times within 300 s"


def test_restart_window_forgets_exits_older_than_the_window() -> None:
    window = RestartWindow(allowed=1, seconds=60.0)
    assert window.give_up(0.0) is None
    assert window.give_up(100.0) is None  # the first exit left the window
    assert window.give_up(120.0) is not None


def test_exit_cause_names_the_code_or_the_signal() -> None:
    assert exit_cause(3) == "engine process exited unexpectedly (exit code 3)"
    assert exit_cause(-9) == "engine process was killed (signal 9)"
