"""One rollout step = one Prefect flow run named `rollout-{rollout_id}`.

sample_prompts -> generate -> filter -> reward -> train -> broadcast_weights -> commit

In async mode (`rollout.off_policy_async`) gates between them let the flow runs of two
consecutive steps overlap; see tasks/step_gates.py for the picture.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.actors import get_or_create_actors
from flows.cluster import connect
from flows.config import RollflowConfig
from flows.reporting import publish_step_report
from storage.run_layout import RunLayout
from tasks import step_gates as gates
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
    layout.clear_failure(rollout_id)
    try:
        metrics = _run_stages(t.StepContext(config, layout, get_or_create_actors(config)), rollout_id)
    except BaseException as e:
        layout.mark_failed(rollout_id, repr(e))
        raise
    # The table only: re-plotting every step would cost more than the step's bookkeeping.
    publish_step_report(layout, rollout_id, metrics, make_plot=False)
    return metrics


def _run_stages(ctx: t.StepContext, rollout_id: int) -> dict[str, Any]:
    pipelined = ctx.cfg.rollout.off_policy_async
    records: dict[str, dict[str, Any]] = {}
    records["sample_prompts"] = t.sample_prompts(ctx, rollout_id)
    if pipelined:
        gates.wait_for_weights(ctx.layout, ctx.cfg, rollout_id)
    records["generate"] = t.generate(ctx, rollout_id)
    records["filter"] = t.filter_groups(ctx, rollout_id)
    records["reward"] = t.reward(ctx, rollout_id, records["filter"]["kept_groups"])
    if pipelined:
        gates.wait_for_previous_commit(ctx.layout, rollout_id)
    records["train"] = t.train(ctx, rollout_id)
    if pipelined:
        gates.wait_for_next_generate(ctx.layout, ctx.cfg, rollout_id)
    records["broadcast_weights"] = t.broadcast_weights(ctx, rollout_id)
    return t.commit(ctx, rollout_id, records)
