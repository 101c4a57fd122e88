"""CI's CPU by kind of process: a fresh clone's `.ci/run` with every process on the machine sampled.

On a 2-core machine CI is bound by CPU: its pytest workers never wait for one another, and
the processes they start keep both cores busy (bench/RESULTS.md, "CI cost"). So its wall
time follows the CPU seconds of everything it starts: pytest's workers, Ray's actors (most of
an actor's CPU is its imports), drivers, Prefect servers, Ray's daemons. To cut it, first see
where those seconds go; this was done by hand for several sessions before it was a module.

This clones the repository's HEAD into a temporary directory, runs `.ci/run` there (or
`scripts/test.sh` with the arguments after `--`), and reads every process's CPU seconds from
/proc twice a second. A process counts from its first reading (or from the start, for one
already running) to its last one before it exited: the CPU of the half second before a
process exits is lost, so short-lived processes are undercounted. Every process on the
machine is counted, so run it on an otherwise idle one: the machine's own daemons land in
"other". Linux only.

    python -m bench.ci_cost                            # `.ci/run` on a fresh clone of HEAD
    python -m bench.ci_cost --json ci.json -- tests/unit -n 2   # scripts/test.sh tests/unit -n 2
    python -m bench.ci_cost --per-test                 # scripts/test.sh, and CPU per test

`--per-test` charges each process's CPU to the test its xdist worker was running when it was
spent: every process a worker starts (its Ray head's actors, drivers, servers) inherits the
worker's `PYTEST_XDIST_WORKER`, read from /proc/<pid>/environ; a worker's own CPU goes to the
test its title names; `bench/pytest_timeline.py` records when each test ran. CPU between a
worker's tests (module fixtures' teardown) goes to the test before, and a fixture's start-up
(the session's Ray head and Prefect server) to the first test that asks for it. A worker's
collection is not charged: it runs before the worker has a title or a test.

Figures: bench/RESULTS.md, "CI cost".
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (a piece of the command line or process title, the kind it marks), first match wins. Ray
# actors are titled `ray::<Class>` (and `ray::<run>:<role>@...` while their __init__ runs).
KINDS: tuple[tuple[str, str], ...] = (
    # (a title read from /proc/<pid>/comm, when the command line is gone, has 15 characters)
    ("ray::TrainActor", "train actors"), (":trainer", "train actors"),
    ("ray::EngineActo", "engine actors"), (":engine", "engine actors"),
    ("ray::RolloutMan", "rollout actors"), (":rollout@", "rollout actors"),
    ("ray::IDLE", "Ray workers before their actor"),
    ("ray::DashboardAgent", "Ray's daemons"), ("ray::RuntimeEnvAgent", "Ray's daemons"),
    ("ray::", "other Ray actors and tasks"),
    ("raylet", "Ray's daemons"), ("gcs_server", "Ray's daemons"),
    ("ray/dashboard", "Ray's daemons"), ("ray.dashboard", "Ray's daemons"),
    ("ray-dashboard", "Ray's daemons"), ("ray.util.client", "Ray's daemons"),
    ("log_monitor", "Ray's daemons"), ("ray/autoscaler", "Ray's daemons"),
    ("uvicorn", "Prefect servers of the test harness"),
    ("prefect_app", "Prefect servers started by runs and tests"),
    ("flows.cli", "drivers (CLI)"), ("rollflow train", "drivers (CLI)"),
    ("prefect.runner", "Prefect workers and their flow runs"),
    ("openenv_server", "environment servers"),
    ("sglang_router", "sglang-router"), ("sglang::router", "sglang-router"),
    ("engines.rollout.router_process", "sglang-router"),
    ("while os.getppid()", "CPU burners of the load tests"),
    ("multiprocessing", "spawned processes (torch ranks, reward workers)"),
    ("mypy", "lint and type checks"), ("ruff", "lint and type checks"),
    ("lint-imports", "lint and type checks"),
    ("compileall", "setup"), ("uv pip", "setup"), ("pip install", "setup"),
    ("moto", "moto (S3)"),
    ("bwrap", "code sandboxes"),
    ("chrom", "browser"),
    # last: a test's own subprocesses carry pytest's temporary paths in their arguments
    ("pytest", "pytest workers"),
)


def kind_of(title: str) -> str:
    """The kind of process a command line or title marks (KINDS), else "other"."""
    for piece, kind in KINDS:
        if piece in title:
            return kind
    return "other"


@dataclass
class Seen:
    """One process: its most telling title and its first and last CPU readings."""

    title: str
    first_cpu: float
    last_cpu: float
    worker: str | None = None  # the xdist worker that started it (--per-test)

    @property
    def cpu(self) -> float:
        return self.last_cpu - self.first_cpu


_ACTOR_KINDS = {"train actors", "engine actors", "rollout actors"}


def better_title(old: str, new: str) -> str:
    """A Ray worker starts as a plain Python command, then takes its actor's title; keep the
    title that names the most: an actor's class over anything, else the longer one."""
    if kind_of(old) in _ACTOR_KINDS:
        return old
    if kind_of(new) in _ACTOR_KINDS:
        return new
    return new if len(new) > len(old) else old


def read_processes(proc: str = "/proc") -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, start tick) -> (title, user + system CPU seconds) of every process now."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat") as f:
                stat = f.read()
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it exited between listdir and the reads
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        title = cmdline or stat[stat.find("(") + 1:stat.rfind(")")]
        out[(int(name), int(fields[19]))] = (title, cpu)  # starttime tells reused pids apart
    return out


def xdist_worker(pid: int, proc: str = "/proc") -> str | None:
    """The `PYTEST_XDIST_WORKER` a process was started with (inherited from the worker that
    started it, or its ancestors), None without one or if it is gone."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"PYTEST_XDIST_WORKER="):
            return entry.split(b"=", 1)[1].decode(errors="replace")
    return None


RUNNING = "[pytest-xdist running] "  # an xdist worker's title while it runs a test


@dataclass
class Sampler:
    """Reads every process's CPU every `period_s` on a thread until `stop()`."""

    period_s: float = 0.5
    per_test: bool = False
    seen: dict[tuple[int, int], Seen] = field(default_factory=dict)
    # (time, worker or RUNNING + a test's node id, CPU-s since the reading before), --per-test
    charges: list[tuple[float, str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        me = os.getpid()
        for key, (title, cpu) in read_processes().items():  # running before: from now
            if key[0] != me:
                self.seen[key] = Seen(title, cpu, cpu)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.period_s):
            self.sample(me)

    def sample(self, me: int) -> None:
        now = time.time()
        spent: dict[str, float] = collections.defaultdict(float)
        for key, (title, cpu) in read_processes().items():
            if key[0] == me:
                continue
            old = self.seen.get(key)
            if old is None:
                worker = xdist_worker(key[0]) if self.per_test else None
                old = self.seen[key] = Seen(title, 0.0, 0.0, worker)  # started since: all of it
            delta, old.last_cpu = cpu - old.last_cpu, cpu
            old.title = better_title(old.title, title)
            if self.per_test and delta > 0:
                if title.startswith(RUNNING):
                    spent[title] += delta
                elif old.worker is not None:
                    spent[old.worker] += delta
        self.charges += [(now, who, seconds) for who, seconds in spent.items()]

    def stop(self) -> dict[str, tuple[float, int]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample(os.getpid())
        return cpu_by_kind(self.seen.values())


def cpu_by_kind(processes: Iterable[Seen]) -> dict[str, tuple[float, int]]:
    """kind -> (CPU seconds, processes that used any), largest first."""
    cpu: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for p in processes:
        if p.cpu > 0:
            kind = kind_of(p.title)
            cpu[kind] += p.cpu
            count[kind] += 1
    return {kind: (cpu[kind], count[kind]) for kind in sorted(cpu, key=cpu.__getitem__, reverse=True)}


def worker_spans(events: Iterable[tuple[str, str, float]]) -> list[tuple[float, str]]:
    """A worker's (start time, node id) per test, in order, from its timeline's events."""
    return sorted((t, node) for kind, node, t in events if kind == "start")


def charge_to_tests(charges: Iterable[tuple[float, str, float]],
                    timelines: dict[str, list[tuple[float, str]]]) -> dict[str, float]:
    """node id -> CPU seconds, costliest first: a charge to worker w at time t goes to the test
    w started last before t (before its first test: "(collection on w)"); a charge to a
    worker's RUNNING title goes to the test it names."""
    cpu: dict[str, float] = collections.defaultdict(float)
    starts = {w: [t for t, _ in spans] for w, spans in timelines.items()}
    for t, who, seconds in charges:
        if who.startswith(RUNNING):
            cpu[who[len(RUNNING):].strip()] += seconds
            continue
        k = bisect.bisect_right(starts.get(who, []), t) - 1
        cpu[timelines[who][k][1] if k >= 0 else f"(collection on {who})"] += seconds
    return dict(sorted(cpu.items(), key=lambda item: -item[1]))


def read_timelines(folder: Path) -> dict[str, list[tuple[float, str]]]:
    return {f.stem: worker_spans(tuple(json.loads(line)) for line in f.read_text().splitlines())
            for f in folder.glob("*.jsonl")}


def table(by_kind: dict[str, tuple[float, int]]) -> str:
    total = sum(seconds for seconds, _ in by_kind.values()) or 1.0
    rows = ["| kind | CPU-s | share | processes |", "|---|---|---|---|"]
    rows += [f"| {kind} | {seconds:,.0f} | {seconds / total:.1%} | {n} |"
             for kind, (seconds, n) in by_kind.items()]
    rows.append(f"| all | {total:,.0f} | | {sum(n for _, n in by_kind.values())} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the sums, the run's outcome and every "
                        "process of a CPU-second or more here")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    parser.add_argument("--per-test", action="store_true",
                        help="run scripts/test.sh with bench/pytest_timeline.py and charge CPU to "
                        "tests (the 25 costliest printed; all of them in --json)")
    parser.add_argument("test_args", nargs="*",
                        help="after --: run scripts/test.sh with these instead of .ci/run")
    args = parser.parse_args(argv)
    clone = Path(tempfile.mkdtemp(prefix="ci-cost-")) / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    timeline = clone.parent / "timeline"
    env = dict(os.environ)
    if args.per_test:
        timeline.mkdir()
        env["ROLLFLOW_TEST_TIMELINE"] = str(timeline)
        command = ["bash", "scripts/test.sh", "-p", "bench.pytest_timeline", *args.test_args]
    else:
        command = (["bash", "scripts/test.sh", *args.test_args] if args.test_args
                   else ["bash", ".ci/run"])
    print(f"{' '.join(command)} in {clone} (HEAD {head})", flush=True)
    sampler = Sampler(per_test=args.per_test).start()
    started = time.monotonic()
    code = subprocess.run(command, cwd=clone, env=env).returncode
    wall = time.monotonic() - started
    by_kind = sampler.stop()
    print(f"\nexit code {code} after {wall:.0f} s (HEAD {head})\n{table(by_kind)}")
    by_test = charge_to_tests(sampler.charges, read_timelines(timeline)) if args.per_test else {}
    for node, seconds in list(by_test.items())[:25]:
        print(f"{seconds:8.1f} CPU-s  {node}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"head": head, "command": command, "exit_code": code, "wall_s": round(wall, 1),
             "cpu_s": {k: [round(s, 1), n] for k, (s, n) in by_kind.items()},
             "cpu_s_by_test": {k: round(s, 2) for k, s in by_test.items()},
             # every process of a CPU-second or more, costliest first: [CPU-s, kind, title]
             "processes": [[round(p.cpu, 2), kind_of(p.title), p.title[:300]]
                           for p in sorted(sampler.seen.values(), key=lambda p: -p.cpu)
                           if p.cpu >= 1.0]}, indent=1))
    if args.keep:
        print(f"clone kept: {clone}")
    else:
        shutil.rmtree(clone.parent, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
