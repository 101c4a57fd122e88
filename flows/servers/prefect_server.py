"""Prefect servers rollflow starts, each running flows/servers/prefect_app.py (Prefect's app, with
SQLite writes that wait their turn instead of failing into a 2 s client retry):

* `rollflow server`: the UI on loopback, for watching and retrying rollout steps. Flow runs
  report to it once `PREFECT_API_URL` points at its API.
* `local_prefect_api()`: without `PREFECT_API_URL`, a driver's own server for as long as it
  runs, in place of Prefect's ephemeral one (the same app and database, `PREFECT_HOME`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx

from engines.process import tls_verify
from flows.bookkeeping.start_lines import phase
from flows.config.run import ConfigError
from flows.servers.prefect_env import SERVER_ENV_DEFAULTS, prefect_env_defaults

log = logging.getLogger(__name__)
# The least a driver waits for its own server's first answer. Prefect's ephemeral default
# (90 s) was too short beside a loaded CI at this Xeon's slow hour: a fresh database's
# migrations alone took about 80 s there, and the run failed before its first step. A
# server that fails exits, which ends the wait at once.
LOCAL_SERVER_STARTUP_S = 300.0
LOCAL_SERVER_LOG = "local-server.log"  # in PREFECT_HOME: a driver's own server's output


@dataclass
class PrefectServer:
    """A `prefect server start` child process and where to reach it."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: str | None = None  # where its output goes, if not to ours

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/health", timeout=2.0,
                             verify=tls_verify(self.api_url)).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.process.poll() is not None:
                where = f" (its output: {self.log_path})" if self.log_path else ""
                raise RuntimeError(
                    f"prefect server exited with code {self.process.returncode}{where}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prefect server on {self.url} not healthy after {timeout_s}s")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _prefect_app() -> list[str]:
    return [sys.executable, "-m", "flows.servers.prefect_app"]


def server_env(home: str | None = None, database: str | None = None) -> dict[str, str]:
    """The server's environment: `home` its PREFECT_HOME (where its SQLite database lives by
    default), `database` another database's URL (PostgreSQL: `postgresql+asyncpg://...`)."""
    env = dict(os.environ)
    prefect_env_defaults(env, SERVER_ENV_DEFAULTS)
    env.pop("PREFECT_API_URL", None)  # the server must not try to report to another server
    if home is not None:
        env["PREFECT_HOME"] = home
    if database is not None:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url(database)
    return env


def database_url(url: str) -> str:
    """A database URL as Prefect's server takes it: a plain `postgresql://` (what psql and
    most tools print) names the asyncpg driver Prefect runs on; anything else is checked."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"--database {url!r}: not a URL (postgresql://user@host:port/db)")
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+asyncpg://{rest}"
    if scheme not in ("postgresql+asyncpg", "sqlite+aiosqlite"):
        raise ConfigError(f"--database {url!r}: Prefect's server runs on PostgreSQL "
                          "(postgresql://...) or SQLite (sqlite+aiosqlite:///path)")
    return url


def _port_in_use(host: str, port: int) -> str | None:
    """Why the server could not bind `host:port` now, or None where it could."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _wait_for_port(host: str, port: int, deadline: float,
                   stop: threading.Event | None = None, poll_s: float = 0.5) -> None:
    """Until `host:port` can be bound, the monotonic `deadline` passes or `stop` is set."""
    stop = stop or threading.Event()
    while (_port_in_use(host, port) is not None and time.monotonic() < deadline
           and not stop.wait(poll_s)):
        pass


def _check_port_free(host: str, port: int) -> None:
    """A second server on a port in use exited at once, after the first one's health check
    had answered for it: the CLI printed the other server's address as its own."""
    why = _port_in_use(host, port)
    if why is not None:
        raise ConfigError(
            f"{host}:{port} is in use ({why}): another server (maybe a Prefect "
            f"server already, at http://{host}:{port}) holds it; pick another --port"
        )


def start_server(
    host: str = "127.0.0.1",
    port: int = 4200,
    home: str | None = None,
    wait_s: float | None = 120.0,
    log_path: str | None = None,
    database: str | None = None,
    port_busy_s: float = 0.0,
) -> PrefectServer:
    """Start the server (UI included) in a child process; `home` is its PREFECT_HOME (the
    SQLite database lives there unless `database` names another). With `wait_s`, return
    once `/api/health` answers.

    `port_busy_s`: for a server started again on its old port, how long to wait for a port
    another socket holds. A port of the kernel's ephemeral range, free a moment ago, can be
    some client's for a while: a restarted server once lost its port between this check and
    its own bind, seconds later, and exited (tests/flow/test_server_faults.py). Within that
    time such a server is started again."""
    deadline = time.monotonic() + port_busy_s
    while True:
        _wait_for_port(host, port, deadline)
        server = _launch(host, port, home, log_path, database)
        if wait_s is None:
            return server
        try:
            server.wait_ready(wait_s)
            return server
        except RuntimeError:  # it exited (the port lost, or another cause): again, in time
            if time.monotonic() >= deadline:
                raise
            log.warning("the Prefect server on %s:%d exited as it started (code %s; its "
                        "output: %s); starting it again", host, port,
                        server.process.returncode, log_path)


def _launch(host: str, port: int, home: str | None, log_path: str | None,
            database: str | None) -> PrefectServer:
    _check_port_free(host, port)
    cmd = [*_prefect_app(), "server", "start", "--host", host, "--port", str(port)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    env = server_env(home, database)
    # The UI's pages call the API at PREFECT_UI_API_URL, derived from these two settings
    # (not from --host/--port): without them a server on another port than 4200 serves a
    # UI that says "Can't connect to Server API at http://127.0.0.1:4200/api".
    env.update(PREFECT_SERVER_API_HOST=host, PREFECT_SERVER_API_PORT=str(port))
    env.setdefault("PREFECT_UI_URL", f"http://{host}:{port}")  # links in notifications
    process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return PrefectServer(process, host, port, log_path)


def serve_forever(
    host: str, port: int, home: str | None, out: TextIO | None = None,
    database: str | None = None,
) -> int:
    """The CLI entry: start, print where it is (to `out`, default stdout; flushed, since the
    command runs on), stay in the foreground until Ctrl-C."""
    server = start_server(host, port, home, wait_s=None, database=database)
    try:
        server.wait_ready(180.0)
        print(f"Prefect UI:  {server.url}", file=out or sys.stdout)
        print(f"export PREFECT_API_URL={server.api_url}", file=out or sys.stdout, flush=True)
        return server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def start_local_server(port: int | None = None, database: str | None = None) -> PrefectServer:
    """A driver's own server: Prefect's app as its ephemeral server runs it (no UI) on
    loopback, on SQLite under PREFECT_HOME unless `database` names another. Its output is
    appended to PREFECT_HOME/local-server.log, not the user's terminal: the server's own
    errors as the driver stops it (a flush cut short) once came before a failed run's cause,
    which must be the first thing a failed command prints."""
    from prefect.settings import PREFECT_HOME

    from engines.process import free_port

    port = port or free_port()
    home = Path(os.environ.get("PREFECT_HOME") or PREFECT_HOME.value()).expanduser()  # (as the server reads it)
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / LOCAL_SERVER_LOG
    with open(log_path, "ab") as out:  # (the child keeps its own copy of the descriptor)
        process = subprocess.Popen([*_prefect_app(), "local", str(port)],
                                   env=server_env(database=database),
                                   stdout=out, stderr=subprocess.STDOUT)
    return PrefectServer(process, "127.0.0.1", port, str(log_path))


@contextmanager
def local_prefect_api() -> Iterator[PrefectServer | None]:
    """Prefect reports to a local server of ours while this lasts, where it would otherwise
    start its ephemeral one: no `PREFECT_API_URL` (environment, profile or a test harness)
    and ephemeral mode allowed. Enter it after `prefect_env_defaults()`."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        phase(f"Prefect: reporting to {PREFECT_API_URL.value() or 'its ephemeral server'}")
        yield None
        return
    phase("Prefect: starting a local server (no PREFECT_API_URL set)")
    server = start_local_server()
    keeper = KeepAlive(server)
    try:
        server.wait_ready(max(float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()),
                              LOCAL_SERVER_STARTUP_S))
        keeper.start()
        with reporting_to(server.api_url):
            yield server
    finally:
        keeper.stop()
        server.stop()


class KeepAlive(threading.Thread):
    """Starts the driver's own server again, on the same port and database, when it dies
    under a running driver (the OOM killer, a stray kill): Prefect's client retries a
    refused connection for a while, so the driver goes on without noticing. Without this
    every thread of the driver sat in those retries and the training hung. A server that is
    alive but has not answered its health check for `hung_after_s` since it last did
    (stopped, deadlocked: one stopped answering after six EP=2 steps on a GPU machine and
    the driver hung) is killed and started again the same way; a server still starting has
    `startup_s` to answer first. A server that keeps dying is left dead after
    `max_restarts`: then the driver fails. A restart first waits up to `port_busy_s` for
    the old port, which another socket can hold for a while (as `start_server`'s
    `port_busy_s`): otherwise each restart on a taken port exits at once, and the five are
    spent in seconds. Start it once the server has answered (`wait_ready`)."""

    def __init__(self, server: PrefectServer, max_restarts: int = 5, poll_s: float = 0.5,
                 probe_s: float = 5.0, hung_after_s: float = 60.0,
                 startup_s: float = 180.0, port_busy_s: float = 60.0) -> None:
        super().__init__(name="prefect-server-keepalive", daemon=True)
        self.server, self.max_restarts, self.poll_s = server, max_restarts, poll_s
        self.probe_s, self.hung_after_s, self.startup_s = probe_s, hung_after_s, startup_s
        self.port_busy_s = port_busy_s
        self.restarts = 0
        self._stopping = threading.Event()
        self._since = time.monotonic()  # the last health answer, or the server's start
        self._has_answered = False
        self._next_probe = 0.0

    def _hung(self) -> bool:
        """Probe the live server now and then; True once it has not answered for long."""
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + self.probe_s
        if self.server.healthy():
            self._since, self._has_answered = now, True
            return False
        limit = self.hung_after_s if self._has_answered else self.startup_s
        return now - self._since > limit

    def run(self) -> None:
        self._since, self._has_answered = time.monotonic(), True  # (started when ready)
        while not self._stopping.wait(self.poll_s):
            code = self.server.process.poll()
            if code is None:
                if self._hung():
                    log.warning("the driver's Prefect server (pid %d) has not answered for "
                                "%.0f s; killing it to start it again", self.server.process.pid,
                                time.monotonic() - self._since)
                    self.server.process.kill()
                    self.server.process.wait()
                continue
            if self.restarts >= self.max_restarts:
                log.error("the driver's Prefect server exited (code %s) %d times: not started "
                          "again (its output: %s)", code, self.restarts + 1, self.server.log_path)
                return
            self.restarts += 1
            log.warning("the driver's Prefect server (pid %d) exited with code %s; starting "
                        "it again on port %d", self.server.process.pid, code, self.server.port)
            _wait_for_port(self.server.host, self.server.port,
                           time.monotonic() + self.port_busy_s, self._stopping, self.poll_s)
            self.server.process = start_local_server(self.server.port).process
            self._since, self._has_answered = time.monotonic(), False  # (starting)

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=10)


@contextmanager
def reporting_to(api_url: str) -> Iterator[None]:
    """Flow runs started within report to the server at `api_url`; what they queued (logs,
    events) reaches it before this ends."""
    from prefect.context import refresh_global_settings_context

    os.environ["PREFECT_API_URL"] = api_url
    refresh_global_settings_context()  # Prefect read its settings at import
    try:
        yield
    finally:
        _drain_prefect_clients()
        del os.environ["PREFECT_API_URL"]
        refresh_global_settings_context()


def _drain_prefect_clients() -> None:
    """Logs and events still queued in this process reach the server before it stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
