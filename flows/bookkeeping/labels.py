"""Labels that tell trainings apart in the Prefect UI, where several share one server: the
tags every flow run of a training carries (filter the runs list by `run:<name>`), and the
train flow run's own tags, set once it has started. The step's task runs carry none
(flows/prefect_workarounds.py says why)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import tags
from prefect.context import FlowRunContext

from flows.config.run import RollflowConfig


def run_tags(cfg: RollflowConfig) -> list[str]:
    """`rollflow`, `run:<name>`, `algo:<advantage estimator>`, `engine:<backend>`,
    `train:<backend>`."""
    return ["rollflow", f"run:{cfg.storage.run_name}", f"algo:{cfg.algorithm.advantage_estimator}",
            f"engine:{cfg.engine.backend}", f"train:{cfg.train.backend}"]


def tag_current_flow_run(labels: list[str]) -> None:
    """Add `labels` to the running flow run. A flow run takes its tags when it is created
    (from the caller's `tags()` or its deployment), before the flow body sees its config."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    wanted = sorted({*ctx.flow_run.tags, *labels})
    if wanted == sorted(ctx.flow_run.tags):
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run(ctx.flow_run.id, tags=wanted)
    ctx.flow_run.tags = wanted


@contextmanager
def labelled(cfg: RollflowConfig) -> Iterator[list[str]]:
    """Within: the current flow run and every flow run started carry the tags (task runs
    inside the rollout steps do not: flows/prefect_workarounds.py)."""
    labels = run_tags(cfg)
    tag_current_flow_run(labels)
    with tags(*labels):
        yield labels
