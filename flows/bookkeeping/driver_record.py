"""Who drives a run: a record in its run directory, so that the next driver can tell an
earlier one that is gone from one still running.

A driver killed outright (`kill -9`, the OOM killer) runs no hook, and Prefect 3.8's server
never ends a flow run whose heartbeats stopped: the UI would show it Running for ever. So a
train flow, when it starts, reads the record of the run's last driver:
- on this machine and its process gone: its flow run, and the step flow runs under it, that
  are still Running or Pending are set Crashed;
- on this machine and its process still running: two drivers of one run would write the same
  steps, so this one stops, naming the other;
- on another machine: nothing can be checked from here (the README's automation ends it).
Then it writes its own record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, replace
from typing import Any
from uuid import UUID

import psutil

from flows.config.run import ConfigError
from storage.run_layout import RunLayout

log = logging.getLogger(__name__)

DRIVER_FILE = "DRIVER.json"


class RunInUseError(ConfigError):
    """Another live driver on this machine drives the run (an input error: exit code 2)."""


@dataclass(frozen=True)
class DriverRecord:
    host: str
    pid: int
    process_started: float  # the process's start time: a reused pid has another
    flow_run_id: str | None
    written_at: float
    run_dir: str = ""  # where it was written: a copied run directory is another run
    ended_at: float | None = None  # the driver finished or failed (its process may live on)

    @classmethod
    def of_this_process(cls, flow_run_id: str | None, run_dir: str = "") -> DriverRecord:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, psutil.Process(pid).create_time(), flow_run_id,
                   time.time(), run_dir)

    def write_to(self, layout: RunLayout) -> None:
        layout.store.write_text(json.dumps(asdict(self)), DRIVER_FILE)

    def running(self) -> bool | None:
        """Whether the driver still drives the run; None when it ran on another machine."""
        if self.ended_at is not None:
            return False
        if self.host != socket.gethostname():
            return None
        try:
            return abs(psutil.Process(self.pid).create_time() - self.process_started) < 1.0
        except psutil.Error:  # no such process (or not ours to look at: treat as gone)
            return False


def current_flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None


def read_record(layout: RunLayout) -> DriverRecord | None:
    if not layout.store.exists(DRIVER_FILE):
        return None
    try:
        return DriverRecord(**json.loads(layout.store.read_text(DRIVER_FILE)))
    except (TypeError, ValueError):  # an older or damaged record says nothing useful
        return None


def take_over(layout: RunLayout, run_dir: str, flow_run_id: str | None) -> list[str]:
    """Become the run's driver (see the module's docstring); returns the ids of the flow
    runs set Crashed. Raises RunInUseError while another driver on this machine runs."""
    me = DriverRecord.of_this_process(flow_run_id, run_dir)
    last = read_record(layout)
    crashed: list[str] = []
    # (the same process drove it before, a retry of this very flow run in a new one, or the
    # record came with a copy of another run's directory)
    if (last is not None and last.pid != me.pid and last.flow_run_id != flow_run_id
            and last.run_dir == run_dir):
        running = last.running()
        if running:
            raise RunInUseError(
                f"{run_dir} is being trained by another driver on this machine (pid "
                f"{last.pid}, flow run {last.flow_run_id}): stop it first (two drivers of one "
                "run would write the same steps), or give this run another storage.run_name"
            )
        if running is False and last.flow_run_id and last.ended_at is None:
            crashed = crash_flow_runs(last.flow_run_id, last.pid)
    me.write_to(layout)
    return crashed


def mark_ended(layout: RunLayout) -> None:
    """This process is done driving the run (finished or failed): `rollflow runs list` must
    not count the run running while the process lives on (a notebook, a test). Never raises:
    the record must not hide how the training ended."""
    try:
        last = read_record(layout)
        if last is not None and last.pid == os.getpid() and last.host == socket.gethostname():
            replace(last, ended_at=time.time()).write_to(layout)
    except Exception as e:  # storage down: the record then says running until the pid is gone
        log.debug("driver record not marked ended: %r", e)


def crash_flow_runs(flow_run_id: str, pid: int) -> list[str]:
    """Set the flow run `flow_run_id` and its child flow runs Crashed where they are still
    Running or Pending (their driver, process `pid`, is gone)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    active_types = [StateType.RUNNING, StateType.PENDING]
    active = FlowRunFilterStateType(any_=active_types)
    message = (f"its driver (pid {pid}) is gone, killed without running any hook; a rerun "
               "of the run took over")
    done: list[str] = []
    with get_client(sync_client=True) as client:
        try:
            runs: list[Any] = [client.read_flow_run(UUID(flow_run_id))]
        except Exception:  # (another server's run, or deleted): nothing to end
            return []
        runs += client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[runs[0].id]),
            state=FlowRunFilterState(type=active)))
        for run in runs:
            if run.state is not None and run.state.type in active_types:
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                done.append(str(run.id))
    if done:
        log.warning("flow run %s of this run was still Running: %s; set Crashed",
                    flow_run_id, message)
    return done
