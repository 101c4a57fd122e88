"""Labels that tell trainings apart in the Prefect UI, where several share one server: the
tags every flow run of a training carries (filter the runs list by `run:<name>`), and the
train flow run's own tags, set once it has started. Task runs carry none (`untagged_tasks`):
Prefect checks each tag of a task run against tag concurrency limits, two API calls and a
lease thread per task."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import tags
from prefect.context import FlowRunContext, TagsContext

from flows.config import RollflowConfig


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
def untagged_tasks() -> Iterator[None]:
    """Within: task runs start without tags. A tagged task run acquires (and then releases)
    a slot of every `tag:<tag>` concurrency limit through the API before it runs, whether or
    not such a limit exists: measured ~0.1 s per task, most of a mock step's orchestration
    cost. The flow run around them keeps its tags, and the UI shows its task runs."""
    with TagsContext(current_tags=set()):
        yield


@contextmanager
def labelled(cfg: RollflowConfig) -> Iterator[list[str]]:
    """Within: the current flow run and every flow run started carry the tags (task runs
    inside the rollout steps do not: `untagged_tasks`)."""
    labels = run_tags(cfg)
    tag_current_flow_run(labels)
    with tags(*labels):
        yield labels
