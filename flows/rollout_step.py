"""One rollout step = one Prefect flow run named `rollout-{rollout_id}`.

sample_prompts -> generate -> filter -> reward -> train -> broadcast_weights -> commit
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.actors import get_or_create_actors
from flows.cluster import connect
from flows.config import RollflowConfig
from storage.run_layout import RunLayout
from tasks import step_tasks as t


def open_layout(cfg: RollflowConfig) -> RunLayout:
    s = cfg.storage
    return RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.storage_options)


@flow(name="rollout_step", flow_run_name="rollout-{rollout_id}", persist_result=False)
def rollout_step(config: RollflowConfig, rollout_id: int) -> dict[str, Any]:
    """Run (or finish) step `rollout_id`; a committed step returns its metrics untouched."""
    connect(config.cluster)
    layout = open_layout(config)
    if layout.is_committed(rollout_id):
        return layout.step_metrics(rollout_id)
    ctx = t.StepContext(config, layout, get_or_create_actors(config))
    records: dict[str, dict[str, Any]] = {}
    records["sample_prompts"] = t.sample_prompts(ctx, rollout_id)
    records["generate"] = t.generate(ctx, rollout_id)
    records["filter"] = t.filter_groups(ctx, rollout_id)
    records["reward"] = t.reward(ctx, rollout_id, records["filter"]["kept_groups"])
    records["train"] = t.train(ctx, rollout_id)
    records["broadcast_weights"] = t.broadcast_weights(ctx, rollout_id)
    return t.commit(ctx, rollout_id, records)
