"""What every task of a rollout step is handed (`StepContext`), how it collects what actor
calls return (`ctx.get`), and how it runs at most once per (run, rollout_id, stage)
(`run_once`).

Actors are called as `ctx.get(actor.method.remote(...))`: `ctx.get` is the context's
`Replies` (engines/cluster/engine_pool.py), `ray.get` unless the context was made with
actors that answer otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from prefect.context import TaskRunContext

from engines.cluster.actors import RunActors, get_or_create_actors
from engines.cluster.engine_pool import RAY_REPLIES, EnginePool, Replies
from engines.config.run import RunConfig
from engines.records import StageRecord
from engines.train.step_settings import StepSettings
from storage.run_layout import RunLayout


class StepContext:
    """What every task of a step needs: the config, where the run lives, the actors (in the
    engine pool that keeps their engines answering and up to date).

    A plain class, not a dataclass: Prefect walks a dataclass (or pydantic) task argument
    field by field, the whole config included, looking for futures to resolve and upstream
    runs to draw, twice per task (bench/RESULTS.md, "Orchestration")."""

    __slots__ = ("cfg", "layout", "pool", "replies", "settings")

    def __init__(
        self, cfg: RunConfig, layout: RunLayout, actors: RunActors,
        replies: Replies = RAY_REPLIES,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.replies = replies
        self.pool = EnginePool(cfg, actors, replies)
        self.settings = StepSettings.of(cfg).digest()  # what each step's train record names

    @property
    def actors(self) -> RunActors:
        """The run's actors as the engine pool last found them."""
        return self.pool.actors

    def get(self, refs: Any) -> Any:
        """What one actor call, or a list of them, returned (waiting for them)."""
        return self.replies.get(refs)

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
        self.pool.actors = get_or_create_actors(self.cfg, pool=len(self.actors.engines))
        return self.actors


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
