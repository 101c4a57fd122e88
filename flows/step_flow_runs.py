"""Each rollout step as a flow run of its own, `{run}/rollout-{k}`, child of `train-{run}`,
with Prefect's bookkeeping for it kept off the step's critical path.

Called as a subflow, a flow run makes its blocking API calls one after the other before its
first task: a tracking task run in the parent (from a fresh client), a search for an earlier
child of that task run, the flow run itself, its rename from the `flow_run_name` template,
then its states. Here step k+1's tracking task run and flow run (already named) are created
by a background thread, on one long-lived client, while step k runs; step k+1 then starts
with only the engine's own state changes (`prefect.flow_engine.run_flow` given that flow
run). The step's tasks reuse the driver's `StepContext` (its actor handles) instead of
looking the actors up again. What this saves is measured by `python -m bench.orchestration`
(bench/RESULTS.md, "Orchestration").

A flow run created ahead for a step that never runs (the run failed or was stopped) is
deleted with its tracking task run when the driver leaves the block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from prefect import Flow, Task
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext, TagsContext
from prefect.flow_engine import run_flow
from prefect.states import Pending

from flows.config import RollflowConfig
from flows.prefect_workarounds import child_flow_heartbeats_off
from tasks.step_context import StepContext

# The driver's context for the step flow run it is about to run in this thread: the flow
# body uses its actor handles and layout instead of attaching again.
DRIVER_CONTEXT: ContextVar[StepContext | None] = ContextVar("rollflow_step_context", default=None)


def step_flow_run_name(config: RollflowConfig, rollout_id: int) -> str:
    return f"{config.storage.run_name}/rollout-{rollout_id}"


class StepFlowRuns:
    """Creates step flow runs one step ahead and runs them in the caller's thread.

    `run(ctx, k)` runs step k in its flow run (created now if it was not created ahead) and
    starts creating step k+1's. Thread-safe: the async mode runs steps from several threads.
    """

    def __init__(self, step_flow: Flow[..., dict[str, Any]], total_steps: int) -> None:
        self.step_flow = step_flow
        self.total_steps = total_steps
        parent = FlowRunContext.get()
        self.parent_flow_run_id = parent.flow_run.id if parent and parent.flow_run else None
        self.tags = sorted(TagsContext.get().current_tags)
        self._tracking_task = Task(name=step_flow.name, fn=step_flow.fn)
        self._client: SyncPrefectClient = get_client(sync_client=True)
        self._client.__enter__()
        self._creator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-flow-runs")
        self._ahead: dict[int, Future[FlowRun]] = {}
        self._lock = threading.Lock()

    def run(self, ctx: StepContext, rollout_id: int) -> dict[str, Any]:
        config: RollflowConfig = ctx.cfg  # type: ignore[assignment]
        flow_run = self._take(config, rollout_id).result()
        if rollout_id + 1 < self.total_steps:
            self._prepare(config, rollout_id + 1)
        token = DRIVER_CONTEXT.set(ctx)
        try:
            with child_flow_heartbeats_off():
                result: dict[str, Any] = run_flow(
                    self.step_flow, flow_run=flow_run,
                    parameters={"config": config, "rollout_id": rollout_id},
                )  # type: ignore[assignment]
            return result
        finally:
            DRIVER_CONTEXT.reset(token)

    def close(self) -> None:
        """Delete the flow runs created ahead that never ran; stop the creator thread."""
        self._creator.shutdown(wait=True)
        for future in self._ahead.values():
            if future.exception() is None:
                flow_run = future.result()
                self._client.delete_flow_run(flow_run.id)
                if flow_run.parent_task_run_id is not None:
                    self._client.delete_task_run(flow_run.parent_task_run_id)
        self._ahead.clear()
        self._client.__exit__(None, None, None)

    def _take(self, config: RollflowConfig, rollout_id: int) -> Future[FlowRun]:
        with self._lock:
            future = self._ahead.pop(rollout_id, None)
        if future is None:
            future = Future()
            future.set_result(self._create(config, rollout_id))
        return future

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


@contextmanager
def step_flow_runs(step_flow: Flow[..., dict[str, Any]], total_steps: int) -> Iterator[StepFlowRuns]:
    runs = StepFlowRuns(step_flow, total_steps)
    try:
        yield runs
    finally:
        runs.close()
