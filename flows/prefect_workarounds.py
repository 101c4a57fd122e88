"""Where rollflow steps around Prefect 3.8's behaviour, one context manager per behaviour.

Each answers something Prefect does that costs a rollout step time or draws it wrongly in
the UI; none changes what Prefect records. The costs are measured by
`python -m bench.prefect_floor` (bench/RESULTS.md, "Prefect floor").

- `untagged_tasks`: a task run that carries tags acquires and then releases a slot of every
  `tag:<tag>` concurrency limit through the API before it runs, whether or not such a limit
  exists (two API calls and a lease thread per task). The step's task runs start without
  tags; the flow run around them keeps its tags, so filtering the runs list still works.
- `results_linked_within_step`: Prefect finds a task's upstream runs by the `id()` of its
  inputs in a registry kept per flow run, which also holds plain values (dicts, floats)
  freed long ago. In a train flow run holding every step's tasks, a later step's new
  objects reused those ids and the graph drew edges from earlier steps' tasks into its gates
  (and the registry grew with every step). Within, the registry is the step's own.
- `child_flow_heartbeats_off`: Prefect's sync flow engine joins a flow run's heartbeat
  thread on exit, and that thread sleeps in 1 s ticks, so every child flow run paid up to a
  second on exit. Child flow runs (a step as a flow run of its own) run without a heartbeat
  thread; the parent `train` flow run keeps its heartbeats, so a crashed driver is still
  detected.

How a step flow run is created and run (ahead of time, its tail off the critical path) is
the other answer to Prefect's subflow behaviour; it lives in flows/step_flow_runs.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.context import FlowRunContext, SettingsContext, TagsContext, get_settings_context
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, Settings


@contextmanager
def untagged_tasks() -> Iterator[None]:
    """Within: task runs start without tags (the flow run keeps its own)."""
    with TagsContext(current_tags=set()):
        yield


@contextmanager
def results_linked_within_step() -> Iterator[None]:
    """Within: task results link to the tasks they feed through a registry of this step's
    own, dropped at its end."""
    current = FlowRunContext.get()
    if current is None:
        yield
        return
    with current.model_copy(update={"run_results": {}}):
        yield


@contextmanager
def child_flow_heartbeats_off() -> Iterator[None]:
    """Flow runs started inside this block run without a heartbeat thread of their own."""
    current = get_settings_context()
    with SettingsContext(profile=current.profile, settings=_without_heartbeats(current.settings)):
        yield


_NO_HEARTBEAT: dict[int, tuple[Settings, Settings]] = {}


def _without_heartbeats(settings: Settings) -> Settings:
    """Settings with flow heartbeats off, cached: building them validates every setting,
    too slow to repeat each step."""
    cached = _NO_HEARTBEAT.get(id(settings))
    if cached is None or cached[0] is not settings:
        updated = settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
        cached = _NO_HEARTBEAT[id(settings)] = (settings, updated)
    return cached[1]
