"""A driver's own Prefect server writes to PREFECT_HOME/local-server.log, not to the user's
terminal: its errors as the driver stops it (a flush cut short, with a traceback) came before
a failed run's cause, which must be the first thing a failed command prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.servers.prefect_server import LOCAL_SERVER_LOG, start_local_server


def test_a_server_that_cannot_start_says_where_its_output_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    server = start_local_server(database="sqlite+aiosqlite:////nonexistent-dir/prefect.db")
    with pytest.raises(RuntimeError) as failed:
        server.wait_ready(120.0)
    log = tmp_path / LOCAL_SERVER_LOG
    assert str(log) in str(failed.value)
    assert "nonexistent-dir" in log.read_text() or "unable to open" in log.read_text().lower()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err  # nothing of the server's on this process's fds
