"""A driver looks its run's actors up once; each step's flow run (`logging.step_flow_runs`)
reuses the handles, and an actor that died between steps is replaced by the retry of the
first task that finds it dead. A step's flow run carries the run's tags, its task runs none
(a tagged task run costs two API calls for tag concurrency limits)."""

from __future__ import annotations

import time
import uuid

import ray

from engines.cluster.actors import attached_actors, get_or_create_actors, kill_run_actors
from engines.cluster.head import connect
from flows.bookkeeping.labels import labelled
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config


def step_run_tags(name: str) -> tuple[list[str], list[list[str]]]:
    """The tags of flow run `name` and of each of its task runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        deadline = time.monotonic() + 60  # the server records task runs from events, later
        while True:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
            if len(tasks) >= 7 or time.monotonic() > deadline:
                return run.tags, [t.tags for t in tasks]
            time.sleep(0.5)


def test_steps_reuse_handles_and_a_dead_actor_is_replaced_by_a_retry(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    from flows.rollout_step import open_layout, rollout_step
    from flows.step_flow_runs import step_flow_runs
    from tasks.step_context import StepContext

    def run_one_step(ctx: StepContext, rollout_id: int) -> None:
        """Step `rollout_id` alone, in a flow run of its own, as the train flow runs it."""
        with step_flow_runs(rollout_step, ctx.cfg, total_steps=rollout_id + 1) as steps:
            steps.run(ctx, rollout_id)

    cfg = arithmetic_config(
        run_name=f"reuse-{uuid.uuid4().hex[:8]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=["rollout.num_rollout=2", "logging.step_flow_runs=true"],
    )
    connect(cfg.cluster)
    try:
        actors = get_or_create_actors(cfg)
        assert attached_actors(cfg) is actors
        ctx = StepContext(cfg, open_layout(cfg), actors)
        with labelled(cfg) as labels:
            run_one_step(ctx, 0)
        assert attached_actors(cfg) is actors  # the step looked nothing up
        flow_tags, task_tags = step_run_tags(f"{cfg.storage.run_name}/rollout-0")
        assert set(labels) <= set(flow_tags) and len(task_tags) == 7 and not any(task_tags)

        ray.kill(actors.rollout)  # dies between steps: step 1's first task finds it dead
        run_one_step(ctx, 1)
        layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
        assert layout.committed_steps() == [0, 1]
        replaced = attached_actors(cfg)
        assert replaced is not actors and replaced.rollout != actors.rollout
    finally:
        kill_run_actors(cfg)
    fresh = attached_actors(cfg)  # killing the run forgets its handles
    try:
        assert fresh.rollout != replaced.rollout
    finally:
        kill_run_actors(cfg)


def test_runs_of_one_name_under_two_roots_keep_their_own_actors(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    """Two checkouts of an example train the same run name: before, the second driver took
    the first's actors for stale ones of its own (other storage section) and killed them."""
    name = f"twin-{uuid.uuid4().hex[:6]}"
    first, second = (
        arithmetic_config(run_name=name, runs_root=str(tmp_path / root / "runs"),
                          data=arithmetic_data, model_dir=tiny_model_dir,
                          ray_address=ray_address)
        for root in ("a", "b"))
    connect(first.cluster)
    try:
        a = get_or_create_actors(first)
        b = get_or_create_actors(second)
        assert ray.get(a.trainer.version.remote()) == 0  # still alive
        assert a.trainer != b.trainer
        assert kill_run_actors(second) == 3  # rollout, trainer, engine-0: b's only
        assert ray.get(a.rollout.__ray_ready__.remote())  # a's actors still serve
    finally:
        kill_run_actors(first)
        kill_run_actors(second)
