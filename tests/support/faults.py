"""Running a training with a fault fired mid-run, and the evidence that the fault took effect
(an actor's process replaced, a task run more than once)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from engines.cluster.registry import get_run_actor
from storage.batch_io import read_samples
from storage.run_layout import RunLayout

THREE_STEPS = ("rollout.num_rollout=3",)  # long enough to fire a fault in step 1
_REFERENCES: dict[tuple[str, tuple[str, ...]], Any] = {}


def reference_run(make_config: Callable[..., Any], *overrides: str,
                  backend: str = "mock") -> Any:
    """The config of an uninterrupted run of `overrides`, trained once per test process: a
    fault test compares its run's files with it, and several tests of a module compare with
    the same one (a run's samples depend on its config and seed, not on its name)."""
    from flows.train import train

    key = (backend, overrides)
    if key not in _REFERENCES:
        cfg = make_config("ref", *overrides, backend=backend)
        train(cfg)
        _REFERENCES[key] = cfg
    return _REFERENCES[key]


def trained_indices(cfg) -> list[int]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return [s.index for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def run_with_fault(cfg, when: Callable[[RunLayout], bool], fault: Callable[[], Any]) -> dict:
    """Run the train flow in a thread; fire `fault` once `when(layout)` holds. The fault's
    return value is in the result as `fault` (e.g. the pid it killed)."""
    result = run_with_faults(cfg, [(when, fault)])
    return {**result, "fault": result["faults"][0]}


def run_with_faults(cfg, faults: list[tuple[Callable[[RunLayout], bool], Callable[[], Any]]]) -> dict:
    """`run_with_fault` with several faults, in order: each `(when, fault)` fires once its
    `when` holds, after the one before it fired. Their return values are in the result as
    `faults`."""
    from flows.train import train

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    result: dict = {}
    # a daemon: a test that times out must not leave the process waiting on it at exit
    thread = threading.Thread(target=lambda: result.update(train(cfg)), daemon=True)
    thread.start()
    fault_results: list[Any] = []
    while thread.is_alive():
        if len(fault_results) < len(faults):
            when, fault = faults[len(fault_results)]
            if when(layout):
                fault_results.append(fault())
        time.sleep(0.01)
    thread.join()
    assert len(fault_results) == len(faults), f"{len(faults) - len(fault_results)} faults never fired"
    assert result, "the train flow did not return"
    return {**result, "faults": fault_results}


def actor_pid(cfg, role: str) -> int:
    """The process of the run's live `role` actor (engine-i or trainer)."""
    return int(ray.get(get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, role)
                       .pid.remote()))


def kill(cfg, role) -> int:
    """ray.kill the run's `role` actor; returns the pid it had."""
    pid = actor_pid(cfg, role)
    ray.kill(get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, role))
    return pid


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class KillWhileWorking:
    """kill -9 of a run's actor inside a call, not between two: asking a busy actor its pid
    (as `kill` does) waits for its call to end. The pid is read once `idle(layout)` holds
    (the actor has nothing to do then), the process's CPU time noted once `ready(layout)`
    holds, and the kill fires after it has used `cpu_s` more: in the call that came next.
    `when` and `fire` go to `run_with_fault`."""

    def __init__(self, cfg: Any, role: str, idle: Callable[[RunLayout], bool],
                 ready: Callable[[RunLayout], bool], cpu_s: float = 0.1) -> None:
        self.cfg, self.role, self.idle, self.ready, self.cpu_s = cfg, role, idle, ready, cpu_s
        self.pid: int | None = None
        self.base: float | None = None

    def when(self, layout: RunLayout) -> bool:
        if self.pid is None:
            if self.idle(layout):
                self.pid = actor_pid(self.cfg, self.role)
            return False
        if self.base is None:
            if self.ready(layout):
                self.base = cpu_seconds(self.pid)
            return False
        return cpu_seconds(self.pid) - self.base >= self.cpu_s

    def fire(self) -> int:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        return self.pid


def task_run_counts(
    cfg, stage: str, until: Callable[[dict[str, int]], bool], timeout_s: float = 60.0
) -> dict[str, int]:
    """`rollout-{k}/{stage}` -> how many times Prefect ran that task (its run_count, retries
    included) in the run's flow runs, once `until(counts)` holds or `timeout_s` passed:
    the server learns of task runs from events, a little after they ran."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        TaskRunFilter,
        TaskRunFilterName,
    )

    run, steps = cfg.storage.run_name, range(cfg.rollout.num_rollout)
    names = [f"rollout-{k}/{stage}" for k in steps]
    # a step's tasks run in its own flow run, `{run}/rollout-{k}`, or in the train flow run
    flow_runs = FlowRunFilter(name=FlowRunFilterName(
        any_=[f"train-{run}", *(f"{run}/rollout-{k}" for k in steps)]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            counts: dict[str, int] = {}
            for run in client.read_task_runs(
                    flow_run_filter=flow_runs,
                    task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=names))):
                counts[run.name] = counts.get(run.name, 0) + run.run_count
            if until(counts) or time.monotonic() > deadline:
                return counts
            time.sleep(0.5)
