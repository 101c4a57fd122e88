"""The real `sglang-router` (0.3.x) as a supervised child process of the RolloutManager.

```
 generation loop ──HTTP──► sglang-router (127.0.0.1:free port) ──► engine 0 /generate
                                 ▲ POST /workers, GET /workers    ──► engine 1 /generate ...
 RolloutManager ── ensure_alive() before every generate/evaluate: restart + re-register if dead
```
The router only load-balances data-plane calls; control calls (`/abort_request` with
`abort_all`, weight updates) go to every engine directly, as slime does, because the router
does not fan them out.

The child gets SIGTERM when its parent dies (PR_SET_PDEATHSIG), so killing the actor that
owns it never leaves a router holding a port.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, BinaryIO

import httpx

from engines.process import ServerExited, free_port, wait_for_health

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
# With `policy="manual"` the router sends every request carrying the same value of this header
# to the same worker: sticky routing for multi-turn sessions (prefix cache stays warm).
STICKY_ROUTING_HEADER = "x-smg-routing-key"


def sticky_headers(session_id: str) -> dict[str, str]:
    """Headers that pin a multi-turn session to one engine behind a manual-policy router."""
    return {STICKY_ROUTING_HEADER: session_id}


def _with_rollflow_on_path(env: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """`env` with the directory that holds rollflow's packages first on PYTHONPATH: the
    router's launcher is a rollflow module, and an actor may import rollflow from a Ray
    working_dir rather than an installed package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: shutdown() is the only cleanup
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# sgl-model-gateway's Prometheus counter of requests it retried on another worker
_RETRIES_METRIC = "smg_worker_retries_total{"


def generate_retries_in(metrics: str) -> int:
    """The router's `/generate` retries in its Prometheus text (summed over its series)."""
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith(_RETRIES_METRIC) and 'endpoint="generate"' in line))


class RouterError(RuntimeError):
    pass


class RouterProcess:
    """Start, register workers with, health-check and restart one sglang-router."""

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "cache_aware",
        host: str = "127.0.0.1",
        startup_timeout_s: float = 60.0,
        extra_args: list[str] | None = None,
    ) -> None:
        if not worker_urls:
            raise RouterError("the router needs at least one engine URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args or [])
        self.restarts = 0
        self.port = 0
        self.metrics_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log, self._log_reader = _unnamed_log()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> str:
        """Launch on a free port (retrying if another process grabbed it), register every
        engine and wait until the router reports them all healthy; returns the URL."""
        last: Exception | None = None
        for _ in range(3):
            self.port = free_port(self.host)
            self._proc = subprocess.Popen(
                self._command(), stdout=self._log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent, env=_with_rollflow_on_path(os.environ),
            )
            try:
                self._wait_http(time.monotonic() + self.startup_timeout_s)
                self.sync_workers(self.worker_urls)
                return self.url
            except RouterError as e:
                last = e
                self._stop_process()
        raise RouterError(
            f"sglang-router did not start: {last}; last log lines:\n{self._log_tail()}"
        )

    def _command(self) -> list[str]:
        # (rollflow's launcher of sglang-router's own router: engines/rollout/router_process.py)
        return [
            sys.executable, "-m", "engines.rollout.router_process",
            "--host", self.host, "--port", str(self.port),
            "--policy", self.policy, "--log-level", "warn",
            # The metrics exporter defaults to a fixed port: a second router on the machine
            # (another run, a test) would die with "Address already in use".
            "--prometheus-host", self.host, "--prometheus-port", str(self._metrics_port()),
            *self.extra_args,
        ]

    def _metrics_port(self) -> int:
        self.metrics_port = free_port(self.host)
        return self.metrics_port

    def generate_retries(self) -> int:
        """`/generate` requests the router sent again to another worker after one failed
        (its own retries: a killed engine's requests), since it started; 0 if its metrics
        do not answer."""
        try:
            text = httpx.get(f"http://{self.host}:{self.metrics_port}/metrics", timeout=5.0,
                             verify=False).text
        except httpx.HTTPError:
            return 0
        return generate_retries_in(text)

    def process_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        if not self.process_alive():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0, verify=False).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure_alive(self) -> bool:
        """Restart the router if it died or stopped answering; True if it was restarted."""
        if self.healthy():
            return False
        log.warning("sglang-router at %s is down; restarting", self.url)
        self._stop_process()
        self.start()
        self.restarts += 1
        return True

    def shutdown(self) -> None:
        self._stop_process()
        self._log.close()
        self._log_reader.close()

    def _stop_process(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def _wait_http(self, deadline: float) -> None:
        try:
            wait_for_health(self.url, self.process_alive, max(deadline - time.monotonic(), 0.0),
                            poll_s=0.1, what="sglang-router")
        except ServerExited:
            raise RouterError(
                f"router process exited with code {self._proc_returncode()}"
            ) from None
        except TimeoutError as e:
            raise RouterError(str(e)) from None

    def _log_tail(self, lines: int = 5) -> str:
        self._log.flush()
        self._log_reader.seek(0)
        text = self._log_reader.read().decode(errors="replace")
        return "".join(text.splitlines(keepends=True)[-lines:])

    def _proc_returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    # -- workers -------------------------------------------------------------------------
    def workers(self) -> list[dict[str, Any]]:
        """The router's `GET /workers` list (url, is_healthy, load, ...)."""
        response = httpx.get(f"{self.url}/workers", timeout=5.0, verify=False)
        response.raise_for_status()
        try:
            listing = response.json()
        except ValueError:
            # Another server took the port between free_port() and the router's bind (a
            # Prefect server's UI answers every path with its HTML page): start() retries.
            raise RouterError(
                f"GET {self.url}/workers did not answer JSON ({response.text[:60]!r}): "
                "not the router, another server holds its port?"
            ) from None
        return list(listing.get("workers", []))

    def sync_workers(self, urls: list[str]) -> None:
        """Make the router's worker set exactly `urls` (engines may be replaced between
        steps) and wait until every one is healthy."""
        wanted = [u.rstrip("/") for u in urls]
        current = {w["url"].rstrip("/"): w for w in self.workers()}
        for url, w in current.items():
            if url not in wanted:
                httpx.delete(f"{self.url}/workers/{w['id']}", timeout=5.0, verify=False)
        for url in wanted:
            if url not in current:
                response = httpx.post(f"{self.url}/workers", json={"url": url}, timeout=5.0,
                                      verify=False)
                if response.status_code >= 400:
                    raise RouterError(f"POST /workers {url} -> {response.status_code}: "
                                      f"{response.text}")
        self.worker_urls = wanted
        self._wait_workers_healthy(time.monotonic() + self.startup_timeout_s)

    def _wait_workers_healthy(self, deadline: float) -> None:
        healthy: set[str] = set()
        while time.monotonic() < deadline:
            healthy = {w["url"].rstrip("/") for w in self.workers() if w.get("is_healthy")}
            if set(self.worker_urls) <= healthy:
                return
            time.sleep(0.1)
        missing = sorted(set(self.worker_urls) - healthy)
        raise RouterError(f"workers not healthy behind the router: {missing}")


def _unnamed_log() -> tuple[BinaryIO, BinaryIO]:
    """A router's output file, with no name: a handle the router writes through and one to
    read its tail back. Its name is removed at once, so the file goes when the last
    handle closes, even when the rollout actor that started the router is killed (how runs
    end their actors): named logs were left in /tmp, 850 of them on one machine."""
    fd, path = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
    try:
        writer = os.fdopen(fd, "ab")
        reader = open(path, "rb")  # noqa: SIM115 (closed in shutdown, or with the process)
    finally:
        os.unlink(path)
    return writer, reader
