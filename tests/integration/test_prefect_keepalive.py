"""The driver's own Prefect server is started again when it stops answering, not only when it
dies: a stopped (SIGSTOP) server is killed after `hung_after_s` and a new one answers on the
same port."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from flows.servers.prefect_server import KeepAlive, start_local_server


def test_a_server_that_stops_answering_is_started_again(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    server = start_local_server()
    keeper = KeepAlive(server, probe_s=0.5, hung_after_s=3.0)
    try:
        server.wait_ready(120.0)
        keeper.start()
        first = server.process
        os.kill(first.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 180.0
        while server.process is first or not server.healthy():
            assert time.monotonic() < deadline, "the stopped server was not replaced"
            time.sleep(0.5)
        assert first.poll() is not None  # killed, not left stopped
        assert keeper.restarts == 1
    finally:
        keeper.stop()
        server.stop()
