"""`rollflow train` tells its start on a terminal only: a script reading stderr still gets a
failure's cause as its first line."""

from __future__ import annotations

import io
import re

import pytest

from flows.bookkeeping.start_lines import FORCE_ENV, phase, stop_telling, tell_start


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _reset(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    yield
    stop_telling()


def test_a_terminal_gets_a_line_per_phase_with_its_time() -> None:
    out = Terminal()
    tell_start(out)
    phase("Prefect: starting a local server")
    phase("step 0: started")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"rollflow: \[ *\d+\.\d s\] Prefect: starting a local server", lines[0])
    assert lines[1].endswith("] step 0: started")
    stop_telling()
    phase("after the start")
    assert len(out.getvalue().splitlines()) == 2


def test_a_pipe_gets_nothing_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    piped = io.StringIO()
    tell_start(piped)
    phase("preflight")
    assert piped.getvalue() == ""
    monkeypatch.setenv(FORCE_ENV, "1")
    tell_start(piped)
    phase("preflight")
    assert piped.getvalue().endswith("] preflight\n")


def test_zero_silences_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_ENV, "0")
    out = Terminal()
    tell_start(out)
    phase("preflight")
    assert out.getvalue() == ""


def test_nothing_is_told_without_the_cli() -> None:
    phase("a deployment's start")  # no tell_start: not the CLI; must not raise or print


def test_a_second_command_in_one_process_starts_afresh() -> None:
    """`main()` twice in one process (tests, notebooks): the first command's terminal does not
    get the second one's lines when the second is told to a pipe."""
    first = Terminal()
    tell_start(first)
    tell_start(io.StringIO())
    phase("preflight")
    assert first.getvalue() == ""
