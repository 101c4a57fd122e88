"""The persistent local Ray cluster: started on demand, reused by every flow run.

A head started here outlives the driver (it is a `ray start --head` process, not an
in-process `ray.init()`), so detached actors holding models survive between flow runs and
between invocations of the CLI. Its address is kept in `~/.rollflow/cluster.json`;
`rollflow cluster down` stops it (and only it: its processes are found by its own temp dir).

Closed by default: Ray's listeners (GCS, raylet, workers) bind every interface whatever
`--node-ip-address` says, and anyone who can reach them can run code as this user. So the
local head is started in this process's Ray auth mode, which `engines/process.py` makes
token auth with rollflow's own token unless the user set `RAY_AUTH_MODE`; its workers
inherit it from the head.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engines.config.cluster import ClusterConfig
from engines.process import HOME, free_port, process_auth_mode

log = logging.getLogger(__name__)
STATE_FILE = HOME / "cluster.json"


# Ray starts its workers at nice 15 unless told otherwise (RayConfig `worker_niceness`), and
# every actor doing rollflow's work is such a worker: beside any program at normal priority
# they got a few percent of the CPU (bench/RESULTS.md, "Busy machine"). 0 keeps the workers
# at the priority of the process that started the head, the user's own.
WORKER_NICENESS_ENV = "RAY_worker_niceness"
# A head's settings for Ray (RayConfig, read from RAY_<name> by the head it starts), unless
# the user set them:
# - the workers at the user's own priority (above);
# - no idle workers started for the first driver (RayConfig `prestart_worker_first_driver`):
#   an actor takes one only where it runs without a runtime_env and belongs to that driver
#   (engines/cluster/registry.py, `actor_options_env`); they sat idle for the head's life
#   otherwise (2 of 4 on a 4-CPU head, ~0.5% of a core and a process each), and starting
#   them competes with the driver's own start on a small machine.
HEAD_ENV_DEFAULTS = {WORKER_NICENESS_ENV: "0", "RAY_prestart_worker_first_driver": "0"}


def _ray_env() -> dict[str, str]:
    """This process's environment for Ray commands (its auth settings included), with
    `HEAD_ENV_DEFAULTS` where the user set nothing."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in HEAD_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return dict(os.environ)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def warn_if_public(what: str, host: str) -> bool:
    """Servers rollflow starts bind loopback unless told otherwise; say so when told."""
    if is_loopback(host):
        return False
    log.warning("%s=%s: reachable from the network, with no authentication in front of it "
                "(bind 127.0.0.1 unless other machines must reach it)", what, host)
    return True


def _ray_cli() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


def read_state() -> dict[str, Any] | None:
    if not STATE_FILE.exists():
        return None
    return json.loads(STATE_FILE.read_text())


def _alive(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def local_gpus() -> int:
    """GPUs torch sees in this process (CUDA_VISIBLE_DEVICES applies): what a local head
    offers its actors. Counted through NVML, so the driver holds no CUDA context."""
    import torch

    return torch.cuda.device_count()


# What `ray.dashboard.optional_deps` imports (the `ray[default]` extra): without them a head
# asked for a dashboard fails to start, so one is asked for only when they are all there.
_DASHBOARD_DEPS = ("aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry.proto",
                   "opentelemetry.exporter.prometheus", "prometheus_client", "pydantic")


# "0": a head without Ray's dashboard, even where `ray[default]` is installed. The dashboard
# and its agent cost about 19 CPU-s a minute on an idle head; the tests whose heads nothing
# reads it from set this (bench/RESULTS.md, "CI cost").
DASHBOARD_SWITCH = "ROLLFLOW_RAY_DASHBOARD"


def dashboard_available() -> bool:
    if os.environ.get(DASHBOARD_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        return all(importlib.util.find_spec(name) is not None for name in _DASHBOARD_DEPS)
    except ImportError:  # a parent package missing
        return False


def start_local_head(num_cpus: int | None = None, num_gpus: int | None = None) -> str:
    """`ray start --head` in this process's auth mode (token unless the user set
    RAY_AUTH_MODE), its session files under ROLLFLOW_HOME/ray, with every GPU torch sees
    (unless `num_gpus`) and, where `ray[default]` is installed and ROLLFLOW_RAY_DASHBOARD is
    not "0", the dashboard on 127.0.0.1 (Ray's state API, `ray list actors`, needs it);
    returns the GCS address."""
    auth = process_auth_mode()
    if auth != "token":
        log.warning("starting the local Ray head without authentication (RAY_AUTH_MODE=%s): "
                    "anyone who can reach this machine can run code on it", auth)
    port = free_port()
    temp_dir = HOME / "ray"
    gpus = local_gpus() if num_gpus is None else num_gpus
    cmd = [
        _ray_cli(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        "--disable-usage-stats", f"--temp-dir={temp_dir}",
        # Ray's log monitor tails every worker's log files for drivers that print them, and
        # no rollflow driver does (`log_to_driver=False`). It polled the files of every worker
        # the head ever started: 2 CPU-s a minute on an idle head after 60 actors, 124 CPU-s
        # over a CI run's heads (bench/RESULTS.md, "CI cost"). The logs stay on disk.
        "--include-log-monitor=false",
        f"--num-cpus={num_cpus or max(os.cpu_count() or 1, 4)}", f"--num-gpus={gpus}",
    ]
    dashboard = None
    if dashboard_available():
        dash_port = free_port()
        # --include-dashboard left unset: a dashboard slow to start on a loaded machine is
        # then logged, not fatal to the head (`true` makes `ray start` fail after 60 s). The
        # agent's fixed default port (52365) would clash with a second head here.
        cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
                f"--dashboard-agent-listen-port={free_port()}"]
        dashboard = f"http://127.0.0.1:{dash_port}"
    else:
        cmd.append("--include-dashboard=false")
    # In a directory of rollflow's own: the head's processes, and every worker they start,
    # inherit it, and a head started in the user's directory broke once that was deleted
    # (its new workers could not even load torch) until `rollflow cluster down`.
    temp_dir.mkdir(parents=True, exist_ok=True)
    # the workers' OpenMP settings and import path, as the actors' runtime_env would give them
    from engines.cluster.registry import head_worker_env

    env = _ray_env()
    env.update(head_worker_env(env))
    subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=temp_dir)
    address = f"127.0.0.1:{port}"
    STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps({
        "address": address, "started_at": time.time(), "auth": auth,
        "temp_dir": str(temp_dir), "dashboard": dashboard, "num_gpus": gpus, **environment(),
    }))
    return address


def environment() -> dict[str, str]:
    """What a local head's workers run: they use the interpreter (and so the packages and
    rollflow checkout) of the process that started the head."""
    return {"python": sys.executable, "rollflow": str(Path(__file__).resolve().parents[2])}


class ClusterMismatch(RuntimeError):
    """The running local head belongs to another Python environment or rollflow checkout."""


def check_environment(state: dict[str, Any]) -> None:
    """Raise unless the head recorded in `state` runs this interpreter and checkout: its
    workers would otherwise import another rollflow (or another venv's packages)."""
    here = environment()
    differ = [f"{key}: head {state.get(key)!r}, here {value!r}"
              for key, value in here.items() if state.get(key, value) != value]
    if differ:
        raise ClusterMismatch(
            f"the local Ray head at {state['address']} belongs to another environment ("
            + "; ".join(differ) + "). Stop it with `rollflow cluster down`, or set cluster.address to a cluster "
            "of this environment"
        )


class BrokenHead(ClusterMismatch):
    """The running local head cannot start workers any more."""


def check_head_usable(state: dict[str, Any]) -> None:
    """Raise, in one line, when a process of the head recorded in `state` runs in a
    directory that no longer exists: the workers it starts inherit that directory and die
    (`ActorDiedError` on every run). Heads rollflow starts run in ROLLFLOW_HOME/ray; one
    started elsewhere (by hand, or by an older rollflow) can be caught out."""
    import psutil

    temp_dir = state.get("temp_dir")
    if not temp_dir:
        return
    for proc in psutil.process_iter(["cmdline"]):
        if not any(temp_dir in arg for arg in proc.info["cmdline"] or []):
            continue
        try:
            cwd = proc.cwd()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if not os.path.isdir(cwd.removesuffix(" (deleted)")) or cwd.endswith(" (deleted)"):
            raise BrokenHead(
                f"the local Ray head at {state['address']} is broken: it runs in "
                f"{cwd.removesuffix(' (deleted)')}, which was deleted, so no worker can start "
                "there; stop it with `rollflow cluster down` (the next run starts a new one)"
            )


def check_auth(state: dict[str, Any]) -> None:
    """A token head needs a token client; an open head works with either, but is said."""
    auth = state.get("auth", "disabled")
    if auth == "token" and process_auth_mode() != "token":
        raise ClusterMismatch(
            f"the local Ray head at {state['address']} requires token auth, and this process "
            f"has RAY_AUTH_MODE={process_auth_mode()}: unset it (rollflow then uses its token)"
        )
    if auth != "token":
        _warn_open_head(str(state["address"]))


@functools.cache  # once per process and head
def _warn_open_head(address: str) -> None:
    log.warning("the local Ray head at %s accepts code from anyone who can reach it (no "
                "auth): `rollflow cluster down`, and the next run starts a closed one", address)


def cluster_address(cfg: ClusterConfig, start: bool = True) -> str | None:
    """The configured address, else the running local head (of this environment), else a
    new one (if `start`)."""
    if cfg.address:
        return cfg.address
    with _head_lock():
        state = read_state()
        if state and _alive(state["address"]):
            check_environment(state)
            check_head_usable(state)
            check_auth(state)
            return str(state["address"])
        return start_local_head(cfg.num_cpus, cfg.num_gpus) if start else None


@contextmanager
def head_starting(cfg: ClusterConfig) -> Iterator[None]:
    """With no local head running, starts one in a thread while the body runs: a driver
    wraps its Prefect server's start in this, so the two start side by side (both take
    seconds; bench/RESULTS.md, "The main job"). The body's own `connect` waits for it on the
    head lock. A failed start is left for that `connect` to repeat and report."""
    state = None if cfg.address else read_state()
    if cfg.address or (state is not None and _alive(state["address"])):
        yield
        return

    def start() -> None:
        try:
            cluster_address(cfg)
        except Exception:  # (connect raises it again, where the user sees it)
            log.debug("the local Ray head's start in the background failed", exc_info=True)

    thread = threading.Thread(target=start, name="rollflow-head-start", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()  # (never exit halfway through `ray start`: its head would go untracked)


@contextmanager
def _head_lock() -> Iterator[None]:
    """One process at a time looks for the local head and starts it if none answers: two
    drivers started together, with no head running, each started one, and the state file
    then named only the last, leaving the other running untracked."""
    STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(STATE_FILE.parent / "cluster.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def connect(cfg: ClusterConfig) -> str:
    """Attach this process to the cluster (idempotent); returns the address used."""
    import ray

    _ray_env()
    address = cluster_address(cfg)
    if not ray.is_initialized():
        ray.init(address=address, namespace=cfg.namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
        _stop_gracefully_on_sigterm()
    return address or ""


def watch_head(address: str, on_lost: Callable[[str], None], interval_s: float = 2.0,
               misses: int = 3) -> threading.Event:
    """Call `on_lost(address)` once, from a daemon thread, when the head's GCS port stops
    answering `misses` times in a row, unless the returned event is set first: a driver
    whose head was stopped under it (another user's `rollflow cluster down --force`)
    otherwise waits 60 s for Ray to give up and dies with Ray's own line, which says nothing
    of the run or how to resume it."""
    stop = threading.Event()

    def watch() -> None:
        missed = 0
        while missed < misses:
            if stop.wait(interval_s):
                return
            missed = 0 if _alive(address) else missed + 1
        if not stop.is_set():
            on_lost(address)

    threading.Thread(target=watch, name="rollflow-head-watch", daemon=True).start()
    return stop


def runs_with_actors(cfg: ClusterConfig) -> list[str]:
    """The runs that have live actors on the local head, in any namespace (none when no head
    is up): what a `rollflow cluster down` would take from under them. Dead detached actors
    leave Ray's registry of names, so every name listed is alive."""
    import ray

    from engines.cluster.registry import run_actors

    state = read_state()
    if state is None or not _alive(state["address"]):
        return []
    _ray_env()
    if not ray.is_initialized():
        ray.init(address=state["address"], namespace=cfg.namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
    return sorted({actor.run_name for actor in run_actors(namespace=None)})


class Terminated(KeyboardInterrupt):
    """SIGTERM to a driver (a scheduler stopping it): unwinds like Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def _stop_gracefully_on_sigterm() -> None:
    """`ray.init` leaves SIGTERM to Ray's core worker, which aborted the driver (exit 134,
    a C++ stack dump) before Prefect could mark its flow run Crashed; a driver stopped by
    SIGTERM now unwinds as on Ctrl-C. Only the main thread may set a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def stop_local_head() -> bool:
    """Stop the head rollflow started, leaving any other Ray on the machine running."""
    state = read_state()
    if state is None:
        return False
    temp_dir = state.get("temp_dir")
    if temp_dir:
        _stop_processes_of(temp_dir)
    else:  # recorded by an older rollflow: all we can do is stop every Ray here
        subprocess.run([_ray_cli(), "stop", "--force"], env=_ray_env(), capture_output=True)
    STATE_FILE.unlink(missing_ok=True)
    return True


def _stop_processes_of(temp_dir: str, wait_s: float = 10.0) -> None:
    """Terminate the head's processes; its workers exit with the raylet. GCS, raylet and
    the monitors name their session dir under `temp_dir` on the command line. The dashboard
    and runtime-env agents (which rename their process) and Ray's client server do not, and
    they outlived the raylet: after `cluster down` they kept listening on the machine's
    address (client server on :10001, the agents on four more ports). Each writes its logs
    under `temp_dir`, so a process holding a file there is the head's too, unless it is a
    driver: drivers (this process included) keep their logs there even after
    `ray.shutdown()`, and they are the user's processes, not the head's."""
    import psutil

    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid == os.getpid():
            continue
        if any(temp_dir in arg for arg in proc.info["cmdline"] or []) or _ray_process_logging_under(
            proc, temp_dir
        ):
            procs.append(proc)
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    for proc in alive:
        proc.kill()


DRIVER_LOG_PREFIX = "python-core-driver-"  # a Ray driver's core-worker log


def _ray_process_logging_under(proc: Any, temp_dir: str) -> bool:
    """Whether `proc` (a psutil.Process) has a file open below `temp_dir` and is not a
    driver (no driver log among them); False where its files cannot be read (another
    user's process, or one that just exited)."""
    import psutil

    prefix = temp_dir.rstrip(os.sep) + os.sep
    try:
        names = [os.path.basename(f.path) for f in proc.open_files() if f.path.startswith(prefix)]
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    return bool(names) and not any(n.startswith(DRIVER_LOG_PREFIX) for n in names)


def status(cfg: ClusterConfig) -> dict[str, Any]:
    """Address, liveness, the dashboard's URL, the cluster's CPUs and GPUs, the named actors
    of the namespace (with the placement-group bundle each is pinned to) and the placement
    groups. Only GCS calls, so it also works on a head without a dashboard."""
    address = cluster_address(cfg, start=False)
    if address is None or not _alive(address):
        return {"address": address, "alive": False, "dashboard": None, "resources": {},
                "actors": [], "placement_groups": []}
    import ray
    from ray._private.state import actors as actor_table
    from ray.util import placement_group_table

    from engines.cluster.placement import actor_bundle
    from engines.cluster.registry import RunActor

    _ray_env()
    dashboard = None
    if not ray.is_initialized():
        ctx = ray.init(address=address, namespace=cfg.namespace, log_to_driver=False,
                       logging_level=logging.WARNING)
        url = ctx.dashboard_url
        dashboard = (url if "://" in url else f"http://{url}") if url else None
    state = read_state()
    auth = process_auth_mode()
    if state and state.get("address") == address:
        dashboard, auth = state.get("dashboard"), state.get("auth", "disabled")
    if dashboard and not _alive(dashboard.split("://", 1)[-1]):
        dashboard = None  # it failed to start (see the head's session logs)
    rows = []
    now_ms = time.time() * 1000
    for name in sorted(ray.util.list_named_actors()):
        try:
            handle = ray.get_actor(name, namespace=cfg.namespace)
        except ValueError:  # died meanwhile
            continue
        info = actor_table(handle._actor_id.hex())
        pin = actor_bundle(handle)
        parsed = RunActor.parse(name)
        rows.append({"name": name, "run": parsed and parsed.run_name, "role": parsed and parsed.role,
                     "state": info.get("State"), "class": info.get("ActorClassName"),
                     "age_s": round((now_ms - float(info.get("StartTime") or now_ms)) / 1000, 1),
                     "bundle": None if pin is None else pin[1]})
    groups = [
        {"name": g["name"], "id": pg_id, "state": g["state"], "bundles": len(g["bundles"])}
        for pg_id, g in placement_group_table().items() if g["state"] != "REMOVED"
    ]
    resources = {k: ray.cluster_resources().get(k, 0.0) for k in ("CPU", "GPU")}
    return {"address": address, "alive": True, "auth": auth, "dashboard": dashboard,
            "resources": resources,
            "actors": rows, "placement_groups": groups}
