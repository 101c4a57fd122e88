"""What every task of a rollout step is handed (`StepContext`), how it calls into actors
(`resolve`), and how it runs at most once per (run, rollout_id, stage) (`run_once`).

Actors are called as `resolve(actor.method.remote(...))`: `resolve` is `ray.get` for object
refs and hands anything else back as it is, so the tasks' logic runs in unit tests with the
fake actors of tests/support/fakes.py, whose `.remote()` returns the value itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from prefect.context import TaskRunContext

from engines.cluster.actors import RunActors, get_or_create_actors
from engines.config.run import RunConfig
from engines.records import StageRecord
from engines.train.step_settings import StepSettings
from storage.run_layout import RunLayout


class StepContext:
    """What every task of a step needs: the config, where the run lives, the actors.

    A plain class, not a dataclass: Prefect walks a dataclass (or pydantic) task argument
    field by field, the whole config included, looking for futures to resolve and upstream
    runs to draw, twice per task (bench/RESULTS.md, "Orchestration")."""

    __slots__ = ("actors", "cfg", "layout", "settings")

    def __init__(self, cfg: RunConfig, layout: RunLayout, actors: RunActors) -> None:
        self.cfg = cfg
        self.layout = layout
        self.actors = actors
        self.settings = StepSettings.of(cfg).digest()  # what each step's train record names

    def save_settings(self) -> None:
        """Store the settings this run's steps train under (once per distinct settings)."""
        self.layout.save_train_settings(StepSettings.of(self.cfg).to_json(), self.settings)

    def reattach(self) -> RunActors:
        """Handles for this task attempt. A retry gets fresh ones (recreating any actor that
        died), so it works even after the failure that made it retry killed an engine or
        the trainer; a first attempt keeps the flow run's handles, since looking the actors
        up again costs several Ray round trips per task (bench/RESULTS.md, "Orchestration")."""
        task_run = TaskRunContext.get()
        if task_run is None or task_run.task_run.run_count <= 1:  # None: called as .fn()
            return self.actors
        # the pool this step started with: `rollflow engines` resizes it only at a weight push
        self.actors = get_or_create_actors(self.cfg, pool=len(self.actors.engines))
        return self.actors


def resolve(value: Any) -> Any:
    """`ray.get` of an object ref or a list of them; any other value is already resolved."""
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    if isinstance(value, list) and any(isinstance(v, ray.ObjectRef) for v in value):
        return ray.get(value)
    return value


R = TypeVar("R", bound=StageRecord)


def run_once(layout: RunLayout, rollout_id: int, kind: type[R], work: Callable[[], R]) -> R:
    """The stage's record from storage if its task already finished, else `work()`'s, timed
    and stored as `tasks/{kind.STAGE}.json` before it is returned."""
    saved = layout.task_record(rollout_id, kind.STAGE)
    if saved is not None:
        return kind.from_json(saved).stored()
    started_at, start = time.time(), time.perf_counter()
    record = work().timed(time.perf_counter() - start, started_at, time.time())
    layout.save_task_record(rollout_id, kind.STAGE, record.to_json())
    return record
