"""Each rollout step as a flow run of its own, `{run}/rollout-{k}`, child of `train-{run}`,
with Prefect's bookkeeping for it kept off the step's critical path.

Called as a subflow, a flow run makes its blocking API calls one after the other before its
first task: a tracking task run in the parent (from a fresh client), a search for an earlier
child of that task run, the flow run itself, its rename from the `flow_run_name` template,
then its states. Here step k+1's tracking task run and flow run (already named) are created
by a background thread, on one long-lived client, while step k runs; step k+1 then starts
with only the engine's own state changes (`prefect.flow_engine.run_flow` given that flow
run). Each step flow run runs in a thread of its own and hands the driver its metrics as
soon as the step is committed: its report (artifacts, curves) and its final state change go
on behind, while the next step starts. The step's tasks reuse the driver's `StepContext`
(its actor handles) instead of looking the actors up again. What this saves is measured by
`python -m bench.orchestration` (bench/RESULTS.md, "Orchestration").

A flow run created ahead for a step that never runs (the run failed or was stopped) is
deleted with its tracking task run when the driver leaves the block.

With `logging.step_flow_runs: false` the steps make no flow runs: the step flow's function
runs in the train flow run (`StepsInThisFlowRun`), its tasks named `rollout-{k}/<task>`.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prefect import Flow, Task
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext, TagsContext
from prefect.flow_engine import run_flow
from prefect.states import Pending

from flows.config.run import RollflowConfig
from flows.prefect_workarounds import child_flow_heartbeats_off
from tasks.step_context import StepContext

CommitHook = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class DriverHandoff:
    """What the driver gives the step flow run it starts in-process: its context (actor
    handles, layout) and where the step's metrics go once it is committed."""

    ctx: StepContext
    on_commit: CommitHook


# Set in the thread that runs a step flow run for the driver; unset, the flow body attaches
# to the run's actors itself (a flow run started some other way).
DRIVER: ContextVar[DriverHandoff | None] = ContextVar("rollflow_step_driver", default=None)


def step_flow_run_name(config: RollflowConfig, rollout_id: int) -> str:
    return f"{config.storage.run_name}/rollout-{rollout_id}"


class StepFlowRuns:
    """Creates step flow runs one step ahead and runs each in a thread of its own.

    `run(ctx, k)` runs step k in its flow run (created now if it was not created ahead),
    starts creating step k+1's, and returns step k's metrics once it is committed. Thread-safe:
    the async mode runs steps from several threads.
    """

    def __init__(self, step_flow: Flow[..., dict[str, Any]], total_steps: int) -> None:
        # Its flow runs are created named (`_create`): run without the name template, the
        # engine does not rename each one (an API call per step).
        self.step_flow = step_flow.with_options()
        self.step_flow.flow_run_name = None
        self.total_steps = total_steps
        parent = FlowRunContext.get()
        self.parent_flow_run_id = parent.flow_run.id if parent and parent.flow_run else None
        self.tags = sorted(TagsContext.get().current_tags)
        self._tracking_task = Task(name=step_flow.name, fn=step_flow.fn)
        self._client: SyncPrefectClient = get_client(sync_client=True)
        self._client.__enter__()
        self._creator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-flow-runs")
        self._runner = ThreadPoolExecutor(max_workers=8, thread_name_prefix="step-flow-run")
        self._ahead: dict[int, Future[FlowRun]] = {}
        self._running: list[Future[dict[str, Any]]] = []
        self._lock = threading.Lock()

    def run(self, ctx: StepContext, rollout_id: int) -> dict[str, Any]:
        config: RollflowConfig = ctx.cfg  # type: ignore[assignment]
        flow_run = self._take(config, rollout_id)
        if rollout_id + 1 < self.total_steps:
            self._prepare(config, rollout_id + 1)
        committed: Future[dict[str, Any]] = Future()
        context = contextvars.copy_context()  # the train flow run, its tags and settings
        finished = self._runner.submit(
            context.run, self._run_flow, DriverHandoff(ctx, committed.set_result), flow_run,
            rollout_id)
        with self._lock:
            self._running = [f for f in self._running if not f.done()] + [finished]
        wait([committed, finished], return_when=FIRST_COMPLETED)
        if committed.done():
            return committed.result()
        return finished.result()  # raises the step's failure

    def _run_flow(self, handoff: DriverHandoff, flow_run: FlowRun, rollout_id: int) -> dict[str, Any]:
        token = DRIVER.set(handoff)
        try:
            with child_flow_heartbeats_off():
                result: dict[str, Any] = run_flow(
                    self.step_flow, flow_run=flow_run,
                    parameters={"config": handoff.ctx.cfg, "rollout_id": rollout_id},
                )  # type: ignore[assignment]
            return result
        finally:
            DRIVER.reset(token)

    def close(self, raise_errors: bool = True) -> None:
        """Wait for the step flow runs still finishing (raising the first failure unless
        told not to), delete those created ahead that never ran, stop the threads."""
        self._runner.shutdown(wait=True)
        self._creator.shutdown(wait=True)
        for future in self._ahead.values():
            if future.exception() is None:
                flow_run = future.result()
                self._client.delete_flow_run(flow_run.id)
                if flow_run.parent_task_run_id is not None:
                    self._client.delete_task_run(flow_run.parent_task_run_id)
        self._ahead.clear()
        self._client.__exit__(None, None, None)
        failures = [f.exception() for f in self._running if f.exception() is not None]
        if raise_errors and failures:
            raise failures[0]  # type: ignore[misc]

    def _take(self, config: RollflowConfig, rollout_id: int) -> FlowRun:
        """Step `rollout_id`'s flow run: the one created ahead, else a new one now."""
        with self._lock:
            ahead = self._ahead.pop(rollout_id, None)
        return ahead.result() if ahead is not None else self._create(config, rollout_id)

    def _prepare(self, config: RollflowConfig, rollout_id: int) -> None:
        with self._lock:
            if rollout_id not in self._ahead:
                self._ahead[rollout_id] = self._creator.submit(self._create, config, rollout_id)

    def _create(self, config: RollflowConfig, rollout_id: int) -> FlowRun:
        """The tracking task run in the train flow run (what the UI draws as the step in the
        train run's graph) and the step's flow run, named, Pending."""
        parent_task_run_id = None
        if self.parent_flow_run_id is not None:
            tracking = self._client.create_task_run(
                task=self._tracking_task, flow_run_id=self.parent_flow_run_id,
                dynamic_key=str(rollout_id), name=f"{self.step_flow.name}-{rollout_id}",
                state=Pending(), task_inputs={},
            )
            parent_task_run_id = tracking.id
        parameters = self.step_flow.serialize_parameters(
            {"config": config, "rollout_id": rollout_id})
        return self._client.create_flow_run(
            flow=self.step_flow, name=step_flow_run_name(config, rollout_id),
            parameters=parameters, parent_task_run_id=parent_task_run_id, state=Pending(),
            tags=self.tags,
        )


class StepsInThisFlowRun:
    """`run(ctx, k)` runs step k's flow function in the current flow run, with the driver's
    context, as `StepFlowRuns.run` does in a flow run of its own."""

    def __init__(self, step_flow: Flow[..., dict[str, Any]]) -> None:
        self.step_flow = step_flow

    def run(self, ctx: StepContext, rollout_id: int) -> dict[str, Any]:
        token = DRIVER.set(DriverHandoff(ctx, on_commit=lambda metrics: None))
        try:
            return self.step_flow.fn(ctx.cfg, rollout_id)
        finally:
            DRIVER.reset(token)


@contextmanager
def step_flow_runs(
    step_flow: Flow[..., dict[str, Any]], config: RollflowConfig, total_steps: int | None = None
) -> Iterator[StepFlowRuns | StepsInThisFlowRun]:
    """How the train flow runs each step of a run, `.run(ctx, k)`: in a flow run of its own,
    created one step ahead (the default; none past `total_steps`, the run's length unless
    given), or in the train flow run (`logging.step_flow_runs: false`)."""
    if not config.logging.step_flow_runs:
        yield StepsInThisFlowRun(step_flow)
        return
    total = config.rollout.num_rollout if total_steps is None else total_steps
    runs = StepFlowRuns(step_flow, total)
    try:
        yield runs
    except BaseException:
        runs.close(raise_errors=False)  # the failure that is on its way out is the one to see
        raise
    runs.close()
