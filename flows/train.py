"""The driver loop: one `rollout_step` flow run per rollout_id, resuming where the run left off.

Like slime's train.py, the loop fits on a screen; the work lives in tasks and actors.
"""

from __future__ import annotations

from typing import Any, cast
from uuid import UUID

import ray
from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.actors import get_or_create_actors, kill_run_actors
from flows.cluster import connect
from flows.config import RollflowConfig
from flows.config_loader import dump_config
from flows.reporting import publish_run_report
from flows.rollout_step import open_layout, rollout_step
from tasks import step_tasks as t


def _progress_bar(cfg: RollflowConfig, start: int) -> Any:
    from tqdm.auto import tqdm

    total = cfg.rollout.num_rollout
    return tqdm(total=total, initial=start, desc="rollout steps", disable=not cfg.logging.progress)


@flow(name="train", flow_run_name="train-{config.storage.run_name}", persist_result=False)
def train(config: RollflowConfig) -> dict[str, Any]:
    connect(config.cluster)
    layout = open_layout(config)
    if not layout.store.exists("config.yaml"):
        layout.store.write_text(dump_config(config), "config.yaml")
    ctx = t.StepContext(config, layout, get_or_create_actors(config))
    start = layout.next_rollout_id()
    restored = ray.get(ctx.actors.trainer.ensure_version.remote(start))
    t.sync_engine_weights(ctx.actors)

    evaluate_now = bool(config.eval.datasets)
    if evaluate_now and config.eval.before_train:
        t.evaluate(ctx, start)
    total = config.rollout.num_rollout
    progress_id = cast(UUID, create_progress_artifact(
        100.0 * start / total, key=f"{config.storage.run_name.lower()}-steps".replace("_", "-"),
        description="rollout steps committed",
    ))
    bar = _progress_bar(config, start)
    for rollout_id in range(start, total):
        metrics = rollout_step(config, rollout_id)
        bar.update(1)
        bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("reward/mean",) if k in metrics})
        update_progress_artifact(progress_id, 100.0 * (rollout_id + 1) / total)
        interval = config.eval.eval_interval
        if evaluate_now and interval and (rollout_id + 1) % interval == 0:
            t.evaluate(ctx, rollout_id + 1)
    bar.close()
    if evaluate_now:
        t.evaluate(ctx, total)
    report = publish_run_report(layout, make_plot=config.logging.plot)
    if not config.cluster.keep_actors:
        kill_run_actors(config)
    return {"run_dir": layout.uri, "resumed_at": start, "restored": restored, **report}
