"""Waiting for an HTTP server (engine, router, SGLang) to answer GET /health."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


class ServerExited(RuntimeError):
    pass


def wait_for_health(
    url: str, is_alive: Callable[[], bool], timeout_s: float, poll_s: float = 0.05, what: str = "server"
) -> None:
    """Return once `{url}/health` answers 200; fail fast if the server's process or thread
    is gone (`is_alive()` false) instead of waiting out the whole timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive():
            raise ServerExited(f"{what} at {url} exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what} at {url} did not become healthy in {timeout_s:.0f} s")
