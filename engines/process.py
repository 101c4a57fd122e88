"""How rollflow's own processes are set up: what every actor, the driver and the servers
they start share, below every other part of `engines/`.

- **Ray auth** (`prepare_ray_auth`): Ray reads `RAY_AUTH_MODE` (and the token) once, when
  `ray` is imported, so setting it just before `ray.init` is too late. Importing `engines`
  (which `flows` and `tasks` do first) therefore defaults this process to token auth with
  rollflow's own token (`$ROLLFLOW_HOME/ray_token`, made once, mode 0600) unless the user
  chose: an explicit `RAY_AUTH_MODE`, `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` is left
  alone. A token client also talks to a cluster without auth, so the default costs nothing.
- **Threads** (`actor_threads`): Ray sets `OMP_NUM_THREADS=1` in every actor that reserves
  no CPU, which is how rollflow's actors run on a cluster without placement, and torch reads
  it at import: left alone, each engine and trainer would compute on one core whatever
  `cluster.actor_num_threads: null` promises ("all cores of the machine").
- **The heap** (`freeze_actor_heap`, `long_lived_frozen`): a long-lived rollflow process
  holds ~500,000 objects the collector tracks (torch, transformers, the prompt set), and
  every full (generation-2) collection walks all of them, a pause of a few tenths of a second
  that lands inside a step (bench/RESULTS.md, "GC pauses"). `gc.freeze()` moves what exists
  now into a permanent generation that collections skip; what a step allocates is still
  collected. A frozen object that later dies is still freed by reference counting; only a
  reference cycle among such objects stays until `gc.unfreeze()`.
- **Servers it starts** (`free_port`, `wait_for_health`): engines, the router, SGLang.
"""

from __future__ import annotations

import functools
import gc
import os
import secrets
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

# --- Ray auth ---------------------------------------------------------------

HOME = Path(os.environ.get("ROLLFLOW_HOME", Path.home() / ".rollflow"))
TOKEN_FILE = HOME / "ray_token"


def auth_token_file() -> Path:
    """The token of rollflow's local heads: made once, readable by its owner only."""
    if not TOKEN_FILE.exists():
        HOME.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it meanwhile
            return TOKEN_FILE
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return TOKEN_FILE


def prepare_ray_auth() -> str:
    """Default this process to token auth with rollflow's token; returns the mode in force."""
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(auth_token_file())
    return os.environ["RAY_AUTH_MODE"]


def process_auth_mode() -> str:
    return os.environ.get("RAY_AUTH_MODE", "disabled")


# --- threads ----------------------------------------------------------------

def machine_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def actor_threads(configured: int | None, sharers: int = 1) -> int:
    """`configured`, or the machine's cores split evenly among `sharers` processes that
    compute at the same time on it (a CPU train group's ranks on one node); at least 1."""
    if configured:
        return configured
    return max(1, machine_cores() // max(1, sharers))


# --- the heap -----------------------------------------------------------------

def _in_ray_actor() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def freeze_actor_heap() -> None:
    """In a Ray actor's process, which the actor owns for its life: collect what is garbage
    now, then exempt every survivor from later collections. Elsewhere (an actor class built
    in-process, as tests and benchmarks do) nothing happens: that process is not the
    actor's to freeze."""
    if _in_ray_actor():
        gc.collect()
        gc.freeze()


@contextmanager
def long_lived_frozen() -> Iterator[None]:
    """The driver's version: what exists on entry is frozen until exit, when it goes back
    to the collector (so a process that runs several flows does not keep their cycles). A
    process that froze its heap itself keeps doing so: nothing is frozen or unfrozen here.

    Nothing is collected first: garbage frozen with the rest waits for the exit, a bounded
    amount, while a full collection of a process that holds much (a test worker that ran
    hundreds of tests: 730,000 objects, 0.36 s of CPU per flow it ran in-process) was paid by
    every flow (bench/RESULTS.md, "CI cost")."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# --- servers it starts -------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" = every interface), for a server about to start."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerExited(RuntimeError):
    pass


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()  # what httpx builds for each client by default


def tls_verify(url: str) -> ssl.SSLContext | bool:
    """httpx's `verify` for a client of `url`: one certificate context for every https client
    (httpx builds a new one per client by default, parsing the CA bundle each time, and the
    remote reward model opens one client per sample; bench/RESULTS.md, "Engine HTTP
    throughput"); none at all for plain http. One-shot calls (`httpx.get(...)`) pass it too:
    each builds a client, and with httpx's default context that is about 19 ms of CPU, so a
    health poll every 0.1 s cost more than the server it waited for (bench/RESULTS.md, "CI
    cost")."""
    return _tls_context() if url.startswith("https://") else False


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
            if httpx.get(f"{url}/health", timeout=2.0, verify=tls_verify(url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what} at {url} did not become healthy in {timeout_s:.0f} s")
