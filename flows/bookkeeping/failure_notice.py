"""What a failed training says about itself, wherever it ran (CLI, deployment, schedule):
the train flow's `on_failure` hook logs one summary to the flow run (the UI's Logs tab),
publishes it as a markdown artifact (`{run}-failure`) and emits the Prefect event
`rollflow.training.failed` carrying it, which an automation can send on (README, "Failure
notices"; examples/failure_alerts.py): which run failed, in which step and task, why, and
how to resume it. (Prefect's own flow-run-failed event carries the whole Ray traceback.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.logging.loggers import flow_run_logger

from flows.bookkeeping.driver_record import RunInUseError
from flows.bookkeeping.root_cause import summarize
from storage.config import StorageConfig
from storage.run_layout import RunLayout
from tasks.artifacts import artifact_key

FAILED_EVENT = "rollflow.training.failed"

# The stages whose records tell how far a step got (broadcast_weights keeps none).
RECORDED_STAGES = ("sample_prompts", "generate", "filter", "reward", "train")


@dataclass(frozen=True)
class Stopped:
    """Where a run stopped: its first uncommitted step and the first stage without a record."""

    committed: int
    step: int | None
    stage: str | None
    step_error: str | None


def where_it_stopped(layout: RunLayout, num_rollout: int, lookahead: int = 4) -> Stopped:
    """The step that failed (FAILED marker; in async mode it may be a later one than the
    first uncommitted step), else the first uncommitted step, and how far it got."""
    first = layout.next_rollout_id()
    if first >= num_rollout:
        return Stopped(first, None, None, None)
    failed = [k for k in range(first, min(first + lookahead, num_rollout)) if layout.failure(k)]
    step = failed[0] if failed else first
    stage = next((s for s in RECORDED_STAGES if layout.task_record(step, s) is None),
                 "broadcast_weights or commit")
    failure = layout.failure(step)
    return Stopped(first, step, stage, failure["error"] if failure else None)


def failure_summary(run: str, where: str, cause: str, stopped: Stopped | None,
                    num_rollout: int | None) -> str:
    """Markdown: what failed, where, and how to go on."""
    lines = [f"# Training `{run}` failed", "", f"**Cause:** {cause}", ""]
    if stopped is not None and stopped.step is not None:
        lines.append(f"**Stopped in:** step {stopped.step}, task `{stopped.stage}` "
                     f"({stopped.committed} of {num_rollout} steps committed)")
    elif stopped is not None:
        lines.append(f"**Stopped after:** all {stopped.committed} steps were committed "
                     "(the final evaluation or report failed)")
    else:
        lines.append("**Stopped in:** before the run directory could be read")
    lines += ["", f"**Run directory:** `{where}`", "",
              "**To resume:** run the same command again (`rollflow train --config ...`) or "
              "press *Retry* on this flow run: committed steps are skipped and the failed "
              "step resumes at the task that failed. Fix the cause first if it is an input "
              "error (a config, dataset or hook named above)."]
    return "\n".join(lines) + "\n"


def _config_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """The parameter `config` as a plain dict (a RollflowConfig in process, JSON from the API)."""
    config = parameters.get("config", {})
    return config.model_dump() if hasattr(config, "model_dump") else dict(config or {})


def _cause(state: Any) -> str:
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        return summarize(result)
    return str(state.message or state.name)


def notify_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """The train flow's on_failure hook. It never raises: a broken notice must not hide the
    failure it reports."""
    logger = flow_run_logger(flow_run, flow)
    try:
        if isinstance(state.result(raise_on_failure=False), RunInUseError):
            return  # the run is fine, another driver trains it: nothing to alert anyone about
        cfg = _config_fields(flow_run.parameters or {})
        storage = cfg.get("storage", {})
        run = storage.get("run_name", flow_run.name)
        num_rollout = cfg.get("rollout", {}).get("num_rollout")
        stopped: Stopped | None = None
        where = f"{storage.get('uri')}/{run}"
        try:
            options = StorageConfig.model_validate(storage).store_options()  # with retries
            layout = RunLayout.open(storage["uri"], run, storage.get("endpoint_url"), options)
            where = layout.uri
            stopped = where_it_stopped(layout, int(num_rollout))
        except Exception as e:  # storage unreachable or the config itself was the problem
            logger.debug("failure notice: run directory not read: %r", e)
        cause = _cause(state)
        text = failure_summary(run, where, cause, stopped, num_rollout)
        logger.error(text)
        create_markdown_artifact(text, key=artifact_key(run, "failure"),
                                 description=f"why training {run} failed and how to resume")
        emit_event(
            event=FAILED_EVENT,
            resource={"prefect.resource.id": f"rollflow.run.{run}", "prefect.resource.name": run},
            related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                      "prefect.resource.role": "flow-run",
                      "prefect.resource.name": flow_run.name}],
            payload={"summary": text, "cause": cause, "run_dir": where,
                     "step": stopped.step if stopped else None,
                     "task": stopped.stage if stopped else None},
        )
    except Exception:
        logger.exception("failure notice could not be written")
