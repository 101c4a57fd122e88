"""CPU seconds of a run spread over several processes, measured without slowing the run.

The meter polls from a thread of the benchmark's own process, while the measured trainer
keeps both cores busy with torch's OpenMP threads. Every wake-up of the meter preempts one
of them, and its partner then spins at the next barrier, so the poll's cost is paid twice
over in the run's wall time. Walking every process on the machine (`/proc/*/cmdline` and
the parent map) at each poll slowed a Ray actor's train step markedly while TRL, measured
in-process, never paid it (bench/RESULTS.md, "vs TRL"). So discovery (the expensive walk)
runs once a second, the poll reads only the followed processes' CPU times, and readings
between polls are interpolated.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from typing import Any


class CpuMeter:
    """Polls the CPU seconds (user + system) of this process tree and of processes whose
    title starts with `prefix`: a run's Ray actors carry `ray::<run>:<role>@...` while their
    `__init__` runs (seconds: they import torch and load models), then only their class
    name, so a process is followed from the first time its title matches. A process that
    exits keeps its last reading, so the sum never goes down."""

    def __init__(self, prefix: str | None = None, period: float = 0.25,
                 discover_every: float = 1.0) -> None:
        import psutil

        self._psutil, self.prefix = psutil, prefix
        self.period, self.discover_every = period, discover_every
        self.own = 0.0  # the meter's own CPU seconds (in this process: not the run's)
        self._own_series: list[tuple[float, float]] = []
        self.followed: dict[int, Any] = {}
        self.roles: dict[int, str] = {}
        self.per_pid: dict[int, list[tuple[float, float]]] = {}
        self._last_discovery = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _discover(self) -> None:
        """Follow new children of this process and new processes titled `prefix...`."""
        me = self._psutil.Process()
        self.followed.setdefault(me.pid, me)
        self.roles.setdefault(me.pid, "driver")
        if self.prefix:
            for p in self._psutil.process_iter(["cmdline"]):
                title = " ".join(p.info["cmdline"] or [])
                if p.pid not in self.followed and title.startswith(self.prefix):
                    self.followed[p.pid] = p
                    self.roles[p.pid] = title[len(self.prefix):].split("@")[0]
        for c in me.children(recursive=True):
            if c.pid not in self.followed:
                with contextlib.suppress(self._psutil.Error):
                    cmd = " ".join(c.cmdline())
                    self.roles[c.pid] = "prefect server" if "prefect" in cmd else c.name()
                    self.followed[c.pid] = c

    def sample(self) -> None:
        start = time.thread_time()
        now = time.time()
        if now - self._last_discovery >= self.discover_every:
            self._discover()
            self._last_discovery = now
        for pid, p in self.followed.items():
            try:
                t = p.cpu_times()
            except self._psutil.Error:
                continue  # exited: its last reading stands
            self.per_pid.setdefault(pid, []).append((now, t.user + t.system))
        self.own += time.thread_time() - start
        self._own_series.append((now, self.own))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> CpuMeter:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @staticmethod
    def _reading(series: list[tuple[float, float]], when: float) -> float:
        """The process's CPU seconds at `when`, linear between the polls around it."""
        i = bisect.bisect_right(series, when, key=lambda s: s[0])
        if i == 0:
            return 0.0
        if i == len(series):
            return series[-1][1]
        (t0, c0), (t1, c1) = series[i - 1], series[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1

    def by_role(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds of each process (by role) between wall times `start` and `end`."""
        out: dict[str, float] = {}
        for pid, series in self.per_pid.items():
            role = self.roles.get(pid, str(pid))
            out[role] = out.get(role, 0.0) + self._reading(series, end) - \
                self._reading(series, start)
        if "driver" in out:
            out["driver"] -= self._reading(self._own_series, end) - \
                self._reading(self._own_series, start)
        return out

    def at(self, when: float) -> float:
        """The run's CPU seconds at wall time `when` (less the meter's own)."""
        total = sum(self._reading(series, when) for series in self.per_pid.values())
        return total - self._reading(self._own_series, when)
