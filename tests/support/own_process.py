"""Each test module in a pytest process of its own, for tests/gpu.

One pytest process that ran every GPU module carried one module's state into the next: the
CUDA context, the NCCL process group and megatron's parallel state that an in-process
megatron backend initialises (and its MASTER_ADDR / MASTER_PORT in os.environ, which every
later subprocess inherits), torch.compile's worker pool. `pytest tests/gpu` stalled where
one module ran beside another's leftovers, while each passed alone.

So the pytest a user starts (the parent) runs no such module itself. At a module's first
selected test it runs `python -m pytest <that module's selected tests>` in a fresh process
(the child; a new session, so a timeout ends its torchrun ranks and engines too), which
writes each test report as a JSON line; the parent then reports them as its own, so `-v`,
`-rA`, `--durations`, `-x` and junit see every test as if it had run there. A child that
outlives `ROLLFLOW_GPU_MODULE_TIMEOUT` seconds (default 600) first dumps every thread's
stack (faulthandler on SIGUSR1), then is killed, and its unreported tests fail with the
stacks and the end of its output. Under `-s` the child's output is echoed as it comes.

Modules run `at_once` at a time (the GPU suite: one per GPU, tests/gpu/conftest.py), all
started at the first isolated test, longest-expected first; `env_for(module, slot)` gives a
child its slot's environment (which GPUs it sees). A child also gets a ROLLFLOW_HOME of its
own, so two at once never share a local head's record. Reports still come in the session's
order: a test waits for its module's child.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

REPORTS_ENV = "ROLLFLOW_TEST_REPORTS"  # set in a child: the file its reports go to
TIMEOUT_ENV = "ROLLFLOW_GPU_MODULE_TIMEOUT"


class ReportWriter:
    """The child's side: every test report, one JSON line each, to `path`; every thread's
    stack to `path.stacks` on SIGUSR1."""

    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config, self.path = config, path
        self.stacks = open(f"{path}.stacks", "w")  # noqa: SIM115 - open while the child lives
        faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self.exitstatus = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:
        # pytest is done and every report is on disk; the interpreter's own teardown (CUDA
        # and NCCL destructors, torch.compile's pool) only costs time, or stalls the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(self, "exitstatus", 1))


EnvFor = Callable[[list[pytest.Item], int], dict[str, str]]


class ModuleProcesses:
    """The parent's side: runs the tests `isolated` picks one module per child process,
    `at_once` children at a time."""

    def __init__(self, config: pytest.Config, isolated: Callable[[pytest.Item], bool],
                 at_once: int = 1, env_for: EnvFor | None = None,
                 first: Callable[[list[pytest.Item]], int] | None = None) -> None:
        self.config, self.isolated = config, isolated
        self.at_once, self.env_for, self.first = max(1, at_once), env_for, first
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, 600))
        self.reports: dict[Path, dict[str, list[pytest.TestReport]]] = {}
        self.failure: dict[Path, str] = {}
        self.seconds: dict[Path, tuple[float, float]] = {}  # (the process's, its tests')
        self.finished: dict[Path, threading.Event] = {}
        self.children: set[subprocess.Popen[bytes]] = set()
        self.stopping = threading.Event()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # pytest-timeout here would time the whole module's process against its first
        # test's limit; each test's own limit holds in the child
        for item in items:
            if self.isolated(item):
                item.add_marker(pytest.mark.timeout(0), append=False)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not self.isolated(item):
            return None
        if not self.finished:
            self._start_all(item.session)
        try:
            self.finished[item.path].wait()
        except BaseException:  # ^C: every child goes too
            self._kill_children()
            raise
        reports = self.reports.get(item.path, {}).pop(item.nodeid, [])
        if not any(r.when == "teardown" for r in reports):  # cut short, or never started
            reports.append(self._lost(item))
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _child_args(self, ids: list[str]) -> list[str]:
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                f"--rootdir={self.config.rootpath}"]
        if self.config.getoption("capture") == "no":
            args.append("-s")
        return args + ids

    def _start_all(self, session: pytest.Session) -> None:
        """Every isolated module's child, `at_once` at a time from a scheduler thread, the
        modules `first` ranks highest first (else in the session's order)."""
        modules: dict[Path, list[pytest.Item]] = {}
        for item in session.items:
            if self.isolated(item):
                modules.setdefault(item.path, []).append(item)
        self.finished = {m: threading.Event() for m in modules}
        order = sorted(modules, key=lambda m: -self.first(modules[m]) if self.first else 0)
        threading.Thread(target=self._schedule, args=(order, modules), daemon=True).start()

    def _schedule(self, order: list[Path], modules: dict[Path, list[pytest.Item]]) -> None:
        free: list[int] = list(range(self.at_once))
        turn = threading.Condition()

        def run(module: Path, slot: int) -> None:
            try:
                env = self.env_for(modules[module], slot) if self.env_for else {}
                self._run_module(module, [i.nodeid for i in modules[module]], env)
            except Exception as exc:  # its tests fail with the cause, the others go on
                self.reports.setdefault(module, {})
                self.failure[module] = f"{module.name}: its process did not run: {exc!r}"
            finally:
                self.finished[module].set()
                with turn:
                    free.append(slot)
                    turn.notify()

        for module in order:
            with turn:
                while not free:
                    turn.wait()
                slot = free.pop(0)
            if self.stopping.is_set():  # the session is over (-x, ^C): report it lost
                self.reports.setdefault(module, {})
                self.failure[module] = f"{module.name}: not run; the session ended first"
                self.finished[module].set()
                with turn:
                    free.append(slot)
                continue
            threading.Thread(target=run, args=(module, slot), daemon=True).start()

    def _kill_children(self) -> None:
        self.stopping.set()
        for proc in list(self.children):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)

    def pytest_sessionfinish(self) -> None:
        self._kill_children()  # modules still running after -x (or any early end)

    def _run_module(self, module: Path, ids: list[str], env: dict[str, str]) -> None:
        work = Path(tempfile.mkdtemp(prefix="rf-module-"))
        path = work / "reports.jsonl"
        echo = self.config.getoption("capture") == "no"
        start = time.monotonic()
        proc = subprocess.Popen(
            self._child_args(ids), cwd=self.config.rootpath,
            env={**os.environ, **env, REPORTS_ENV: str(path),
                 "ROLLFLOW_HOME": str(work / "home")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.children.add(proc)
        if self.stopping.is_set():  # the session ended while it started
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.stdout is not None
        tail: list[bytes] = []
        pump = threading.Thread(target=_pump, args=(proc.stdout, tail, echo), daemon=True)
        pump.start()
        try:
            proc.wait(timeout=self.timeout_s)
            why = f"its process exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # the child's stacks, then the whole session
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"its process was killed after {self.timeout_s:.0f} s"
        finally:
            self.children.discard(proc)
        pump.join(timeout=10)
        by_id: dict[str, list[pytest.TestReport]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                data = json.loads(line)
                if isinstance(data.get("longrepr"), list):  # a skip's (path, line, reason)
                    data["longrepr"] = tuple(data["longrepr"])
                report = self.config.hook.pytest_report_from_serializable(
                    config=self.config, data=data)
                by_id.setdefault(report.nodeid, []).append(report)
        self.reports[module] = by_id
        self.seconds[module] = (time.monotonic() - start,
                                sum(r.duration for rs in by_id.values() for r in rs))
        stacks = Path(f"{path}.stacks")
        self.failure[module] = "\n".join([
            f"{module.name}: this test did not finish; {why} "
            f"({time.monotonic() - start:.0f} s).",
            *(["-- stacks at the timeout --", stacks.read_text()]
              if stacks.exists() and stacks.stat().st_size else []),
            "-- the end of its output --", b"".join(tail).decode(errors="replace")[-6000:],
        ])

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.seconds:
            return
        terminalreporter.write_sep("=", "a process per module: its seconds (its tests')")
        for module, (wall, tests) in self.seconds.items():
            terminalreporter.write_line(f"{wall:7.1f} s ({tests:6.1f} s)  {module.name}")

    def _lost(self, item: pytest.Item) -> pytest.TestReport:
        def fail() -> None:
            pytest.fail(self.failure[item.path], pytrace=False)

        call: pytest.CallInfo[None] = pytest.CallInfo.from_call(fail, "call")
        return pytest.TestReport.from_item_and_call(item, call)


def _pump(stream: IO[bytes], tail: list[bytes], echo: bool) -> None:
    """The child's output: its last 64 KiB kept in `tail`; echoed as it comes if `echo`."""
    kept = 0
    for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
        if echo:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        tail.append(chunk)
        kept += len(chunk)
        while kept > 65536 and len(tail) > 1:
            kept -= len(tail.pop(0))


def register(config: pytest.Config, isolated: Callable[[pytest.Item], bool], at_once: int = 1,
             env_for: EnvFor | None = None,
             first: Callable[[list[pytest.Item]], int] | None = None) -> Any:
    """In a child, its report writer; otherwise the parent's module runner for `isolated`,
    `at_once` modules at a time (see the module's docstring for `env_for` and `first`)."""
    path = os.environ.get(REPORTS_ENV)
    plugin = (ReportWriter(config, path) if path
              else ModuleProcesses(config, isolated, at_once, env_for, first))
    config.pluginmanager.register(plugin, "rollflow-own-process")
    return plugin
