"""A Prefect server started again on its old port (`start_server(port_busy_s=...)`) waits
for a port another socket holds, and is started again if it exits as it starts (it lost
the port between the check and its bind); without `port_busy_s` both fail at once, as a
first start on a taken `--port` must. The driver's KeepAlive waits for the port too."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pytest

from engines.process import free_port
from flows.config.run import ConfigError
from flows.servers import prefect_server
from flows.servers.prefect_server import PrefectServer, start_server


class FakeProcess:
    """A server process that has exited with `returncode` (None: running)."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode, self.pid = returncode, 1

    def poll(self) -> int | None:
        return self.returncode


def fake_launches(monkeypatch: pytest.MonkeyPatch, exits: list[bool]) -> list[int]:
    """`_launch` replaced: launch i exits at once (code 3, as uvicorn on a taken port) if
    `exits[i]`, else comes up healthy. Returns the ports launched on."""
    launched: list[int] = []

    def launch(host: str, port: int, home: str | None, log_path: str | None,
               database: str | None) -> PrefectServer:
        prefect_server._check_port_free(host, port)
        exited = exits[len(launched)]
        launched.append(port)
        return PrefectServer(FakeProcess(3 if exited else None), host, port)  # type: ignore[arg-type]

    monkeypatch.setattr(prefect_server, "_launch", launch)
    monkeypatch.setattr(PrefectServer, "healthy",
                        lambda self: self.process.poll() is None)
    return launched


def held_port(release_after_s: float) -> tuple[int, threading.Thread]:
    """A port a plain bound socket (as a client's) holds for `release_after_s`."""
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))

    def release() -> None:
        threading.Event().wait(release_after_s)
        holder.close()

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return port, thread


def test_a_restart_waits_for_its_port_to_come_free(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    launched = fake_launches(monkeypatch, [False])
    port, holder = held_port(1.0)
    server = start_server("127.0.0.1", port, str(tmp_path), wait_s=5, port_busy_s=30)
    assert server.port == port and launched == [port]
    holder.join()


def test_a_first_start_on_a_taken_port_fails_at_once(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    launched = fake_launches(monkeypatch, [False])
    port, holder = held_port(1.0)
    with pytest.raises(ConfigError, match="is in use"):
        start_server("127.0.0.1", port, str(tmp_path), wait_s=5)
    assert launched == []
    holder.join()


def test_a_restart_that_exits_as_it_starts_is_started_again(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    launched = fake_launches(monkeypatch, [True, False])
    port = free_port()
    server = start_server("127.0.0.1", port, str(tmp_path), wait_s=5, port_busy_s=30)
    assert server.process.poll() is None and launched == [port, port]


def test_a_first_start_that_exits_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_launches(monkeypatch, [True, False])
    with pytest.raises(RuntimeError, match="exited with code 3"):
        start_server("127.0.0.1", free_port(), str(tmp_path), wait_s=5)


def test_a_drivers_own_server_gets_at_least_the_local_startup_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect's ephemeral start-up timeout (90 s by default) ended a run on a loaded machine
    while its server's fresh database still migrated: the driver waits at least
    LOCAL_SERVER_STARTUP_S for its own server."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    waited: list[float] = []
    monkeypatch.setattr(prefect_server, "start_local_server",
                        lambda: PrefectServer(FakeProcess(None), "127.0.0.1", free_port()))  # type: ignore[arg-type]
    monkeypatch.setattr(PrefectServer, "wait_ready", lambda self, timeout_s: waited.append(timeout_s))
    monkeypatch.setattr(PrefectServer, "stop", lambda self, timeout_s=20.0: None)
    monkeypatch.setattr(prefect_server.KeepAlive, "start", lambda self: None)
    monkeypatch.setattr(prefect_server, "reporting_to", lambda url: contextlib.nullcontext())
    # Settings, not the environment: a Prefect harness earlier in this worker's session
    # (CI's xdist workers mix tiers) points PREFECT_API_URL at itself through its settings.
    with temporary_settings(
            restore_defaults={PREFECT_API_URL},
            updates={PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: True,
                     PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 90}), \
            prefect_server.local_prefect_api() as server:
        assert server is not None
    assert waited == [prefect_server.LOCAL_SERVER_STARTUP_S] and waited[0] >= 300


def test_keepalive_waits_for_its_port_before_starting_the_server_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's own server died; its port is some client's for a moment: KeepAlive's
    restart waits for it instead of spending its restarts on a port it cannot bind."""
    port, holder = held_port(1.5)
    port_free_at_start: list[bool] = []

    def restart(port: int) -> PrefectServer:
        port_free_at_start.append(prefect_server._port_in_use("127.0.0.1", port) is None)
        return PrefectServer(FakeProcess(None), "127.0.0.1", port)  # type: ignore[arg-type]

    monkeypatch.setattr(prefect_server, "start_local_server", restart)
    monkeypatch.setattr(PrefectServer, "healthy", lambda self: True)
    keeper = prefect_server.KeepAlive(
        PrefectServer(FakeProcess(-9), "127.0.0.1", port), poll_s=0.05, port_busy_s=30)  # type: ignore[arg-type]
    keeper.start()
    holder.join()
    for _ in range(200):  # (10 s at most)
        if port_free_at_start:
            break
        threading.Event().wait(0.05)
    keeper.stop()
    assert port_free_at_start == [True] and keeper.restarts == 1
