"""Session-wide real infrastructure for tests: a local Ray head, one Prefect test harness,
a tiny HF model and the arithmetic datasets. Everything runs on 127.0.0.1 and is torn down
at the end of the session; under pytest-xdist each worker has its own of each (its own Ray
head, Prefect server, moto server, ROLLFLOW_HOME and temporary directories).

Each test gets a cost marker from its directory (`unit`, `integration`, `flow`, `e2e`; see
pyproject.toml) and that tier's timeout unless it sets its own. Tests run costliest tier
first, so that under xdist (`--dist loadfile`: a module's tests share one worker and its
module fixtures) the long ones do not start last.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import psutil
import pytest

from tests.support import REPO_ROOT
from tests.support.configs import arithmetic_config
from tests.support.servers import FaultMatrix

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rollflow's own state (local-head record, Ray token, error logs) stays out of ~/.rollflow;
# short, under /tmp, because Ray's socket paths are limited in length. An xdist worker
# inherits the controller's environment, so it makes its own.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# Heads that rollflow starts for a test (its drivers and `rollflow cluster up` in
# subprocesses) run without Ray's dashboard, about 19 CPU-s a minute each while up: no test
# reads it but test_cluster_head's, which asks for one.
os.environ.setdefault("ROLLFLOW_RAY_DASHBOARD", "0")
if _WORKER:
    os.environ["ROLLFLOW_HOME"] = tempfile.mkdtemp(prefix=f"rf-test-{_WORKER}-", dir="/tmp")
else:
    os.environ.setdefault("ROLLFLOW_HOME", tempfile.mkdtemp(prefix="rf-test-", dir="/tmp"))

# directory -> (cost marker, default per-test timeout in seconds, order: costliest first).
# A timeout is a few times the tier's longest test under `scripts/test.sh` (a flow or e2e
# test up to ~240 s beside the other workers, one of the other tiers under ~50 s), so that a
# hang costs minutes, not the run. A timeout ends the test's worker (pyproject's
# timeout_method), so one that is too tight is a crash, not a failure.
TIERS = {
    "e2e": ("e2e", 600, 0),
    "flow": ("flow", 600, 1),
    "integration": ("integration", 180, 2),
    "gpu": ("gpu", 600, 3),
    "unit": ("unit", 120, 4),
    "plugin_contracts": ("unit", 120, 4),
}


def _tier(item: pytest.Item) -> tuple[str, int, int]:
    parts = item.path.relative_to(REPO_ROOT / "tests").parts
    return TIERS.get(parts[0], ("unit", 120, 4))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker, timeout, _ = _tier(item)
        item.add_marker(marker)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout))
    # stable: file order within a tier; an e2e test elsewhere counts as e2e
    items.sort(key=lambda item: 0 if item.get_closest_marker("e2e") else _tier(item)[2])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from examples.arithmetic.build_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"), num_layers=2, hidden_size=64)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from examples.arithmetic.make_data import write_datasets

    return write_datasets(str(tmp_path_factory.mktemp("data")), n_train=200, n_test=40, n_sft=100)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """A Ray head owned by this test session (in-process start, stopped at the end)."""
    import ray
    from ray._private.node import Node

    from engines.cluster.head import HEAD_ENV_DEFAULTS
    from engines.cluster.registry import head_worker_env

    # as on a head rollflow starts: the actors at the tests' own priority (at Ray's nice 15
    # they starved beside the other xdist workers, and a fault test timed out in CI), no idle
    # workers for the first driver, and the workers' OpenMP settings and import path (this
    # checkout) in the head's own environment, so the actors of the tests' in-process runs
    # need no runtime_env. The head's processes inherit this process's environment as
    # `ray.init` starts them; it is restored after.
    for name, value in HEAD_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    saved = dict(os.environ)
    os.environ.update(head_worker_env(os.environ))
    # and no log monitor, as a head rollflow starts (`--include-log-monitor=false`, see
    # engines/cluster/head.py), which `ray.init` has no argument for. This head has no
    # dashboard, so nothing reads the node stats its dashboard agent's reporter collects
    # every 5 s by default (about 1 CPU-s a minute, the whole session long).
    os.environ["REPORTER_UPDATE_INTERVAL_MS"] = "600000"
    # Nor the autoscaler's monitor, busy the whole session long and of no use to one fixed
    # node. The dashboard's process, which `ray.init` starts all the same with only its
    # usage-stats module, stays: without it the dashboard agent's event module asks the GCS
    # for its address every second and logs a traceback each time, at more CPU than it saves.
    no_log_monitor = mock.patch.object(Node, "start_log_monitor", lambda self: None)
    no_monitor = mock.patch.object(Node, "start_monitor", lambda self: None)
    try:
        with no_log_monitor, no_monitor:
            ctx = ray.init(
                address="local",  # never join a cluster left running by `rollflow` itself
                num_cpus=4, namespace="rollflow-tests", include_dashboard=False,
                log_to_driver=False,
            )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # The harness's server without the loop services no test of it uses (schedules, late and
    # paused runs, workers, concurrency leases, automations): they poll its database every
    # 5-60 s, 1.25 of its 2.8 CPU-s a minute idle, the whole session long, on each xdist
    # worker (bench/RESULTS.md, "CI cost"). Only this server: the servers tests start
    # themselves (the UI's automation test) keep them all. Its process inherits this
    # environment as the harness starts it; it is restored after.
    saved = dict(os.environ)
    os.environ.update({f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in _IDLE_SERVICES})
    try:
        harness = prefect_test_harness(server_startup_timeout=120)
        harness.__enter__()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield str(PREFECT_API_URL.value())
    finally:
        harness.__exit__(None, None, None)


# Prefect server loop services the tests' harness server runs without (see `prefect_api`).
_IDLE_SERVICES = ("CANCELLATION_CLEANUP", "FOREMAN", "LATE_RUNS", "SCHEDULER",
                  "PAUSE_EXPIRATIONS", "REPOSSESSOR", "CLEANUP_RECONCILER", "TRIGGERS")


@pytest.fixture
def run_ray_address() -> str:
    """The Ray address a test's configs name: none for unit tests (tests/flow, tests/e2e and
    tests/integration override it with the session's head)."""
    return "unused"


@pytest.fixture
def make_config(
    run_ray_address: str, arithmetic_data: dict[str, str], tiny_model_dir: str, tmp_path: Any
) -> Callable[..., Any]:
    """`make_config(name, *overrides, backend="mock", runs_root=None, unique=True)`: the
    arithmetic run config (tests/support/configs.py) with `--set`-style overrides, its run
    `name-xxxxxx` (`name` itself with unique=False: the same run again) in tmp_path/runs;
    `backend` "embedded" pairs the embedded engine with the torch trainer."""

    def make(name: str = "run", *overrides: str, backend: str = "mock",
             runs_root: str | None = None, unique: bool = True) -> Any:
        return arithmetic_config(
            run_name=f"{name}-{uuid.uuid4().hex[:6]}" if unique else name,
            runs_root=runs_root or str(tmp_path / "runs"),
            data=arithmetic_data, model_dir=tiny_model_dir, ray_address=run_ray_address,
            backend=backend, overrides=list(overrides),
        )

    return make


@pytest.fixture(scope="module")
def mock_engines() -> Iterator[list[str]]:
    """The URLs of two mock engines (SGLang's HTTP protocol, in this process)."""
    from engines.inference.engine_actor import EngineActor
    from flows.config.run import EngineConfig

    engines = [EngineActor(EngineConfig(backend="mock"), i) for i in range(2)]
    yield [e.url() for e in engines]
    for e in engines:
        e.shutdown()


# -- what a test leaves running ------------------------------------------------------------
def _named_actors() -> set[tuple[str, str]]:
    import ray

    if not ray.is_initialized():
        return set()
    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


# Helpers started once and kept for the session, never a test's leftovers: multiprocessing's
# (the grading pool's workers are the fork server's children) and torch.compile's worker
# pool. Killing the pool stalls this process's next compile for good: it keeps its own copy
# of the pool's pipe ends, so it never sees the pool go and waits on the jobs it sends.
_KEPT = ("multiprocessing.forkserver", "multiprocessing.resource_tracker",
         "torch/_inductor/compile_worker")


def _kept(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(k in " ".join(proc.cmdline()) for k in _KEPT)
    return True


def _kill_tree(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        procs = [proc, *proc.children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)


@pytest.fixture(autouse=True)
def kill_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that may start processes: kill the named Ray actors and the child
    processes it started and left alive (a failed run keeps its actors for a resume; an
    assertion can fire before a test's own cleanup)."""
    if request.node.get_closest_marker("unit"):
        yield
        return
    me = psutil.Process()
    children = {p.pid for p in me.children()}
    actors = _named_actors()
    yield
    import ray

    for namespace, name in _named_actors() - actors:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    for child in me.children():
        if child.pid not in children and not _kept(child):
            _kill_tree(child)


# -- the fault matrix ----------------------------------------------------------------------
FAULT_ROWS: list[tuple[str, ...]] = []


@pytest.fixture
def fault_matrix(request: pytest.FixtureRequest) -> FaultMatrix:
    return FaultMatrix(request.node.user_properties)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        FAULT_ROWS.extend(row for key, row in report.user_properties if key == FaultMatrix.KEY)


# -- a process that does not end ------------------------------------------------------------
EXIT_WATCHDOG_S = 180


def pytest_unconfigure(config: pytest.Config) -> None:
    """After the session's teardown: name the non-daemon threads still alive (the interpreter
    waits for them at exit), and if the process has not ended within EXIT_WATCHDOG_S, print
    every thread's stack and end it, so that a hang at exit fails the run instead of stalling
    it (an xdist worker that never exits holds the whole run)."""
    import faulthandler
    import sys
    import threading
    import traceback

    frames = sys._current_frames()
    for t in threading.enumerate():
        if not t.daemon and t is not threading.main_thread() and t.ident in frames:
            where = "".join(traceback.format_stack(frames[t.ident])[-6:])
            print(f"conftest: a non-daemon thread alive at exit, {t.name}:\n{where}",
                  file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if FAULT_ROWS:
        terminalreporter.write_sep("=", "fault matrix")
        terminalreporter.write_line(FaultMatrix.table(FAULT_ROWS))
