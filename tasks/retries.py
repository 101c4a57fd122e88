"""How a step's tasks retry, and what the Prefect UI calls them.

A failure that comes out the same however often it is retried (a bad input, a corrupt file,
a hook of the wrong type) is reported at once; anything else (an engine or actor briefly
unreachable) is retried twice. The decision is logged to the task run.
"""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from engines.data.prompt_dataset import DatasetError
from engines.hooks.loader import HookError
from engines.rollout.rewards.hub import RewardConfigError
from engines.train.errors import LoraResumeError, ParallelLayoutError
from engines.train.finite import NonFiniteError
from storage.integrity import CorruptFileError
from storage.sample import RewardError

# Failures that come out the same however often they are retried: a bad input or a
# corrupt file (fix it and rerun) is reported at once instead of after two retries.
DETERMINISTIC: tuple[type[BaseException], ...] = (
    CorruptFileError, DatasetError, HookError, LoraResumeError, NonFiniteError,
    ParallelLayoutError, RewardConfigError, RewardError,
)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry_condition_fn: retry unless the failure is deterministic (Ray raises a
    task's exception as a subclass of the original, so isinstance sees through it). Prefect
    calls it only while retries are left; the decision is logged to the task run, so the UI
    says what failed and whether it was retried (not just "Run Count 2")."""
    try:
        state.result()
    except DETERMINISTIC as e:
        _log_retry(task, task_run, e, retried=False)
        return False
    except BaseException as e:
        _log_retry(task, task_run, e, retried=True)
        return True
    return True


def failure_line(exc: BaseException) -> str:
    """`ConnectionError: injected transient fault`: the cause inside Ray's wrapper, first line."""
    cause = getattr(exc, "cause", None)
    root = cause if isinstance(cause, BaseException) else exc
    text = str(root).strip().splitlines()
    return f"{type(root).__name__}: {text[0]}" if text else type(root).__name__


def _log_retry(task: Any, task_run: Any, exc: BaseException, retried: bool) -> None:
    from prefect.logging.loggers import task_run_logger

    if task is None or task_run is None:  # asked outside a task run: nothing to log to
        return
    attempt = task_run.run_count
    logger = task_run_logger(task_run, task=task)
    if retried:
        logger.warning("%s attempt %d failed with %s; retrying (attempt %d of %d)",
                       task.name, attempt, failure_line(exc), attempt + 1, task.retries + 1)
    else:
        logger.error("%s attempt %d failed with %s; not retried: the same input fails the "
                     "same way (fix it and rerun the step)", task.name, attempt, failure_line(exc))


def step_run_name(stage: str) -> str:
    """A step task's run name, `rollout-{rollout_id}/<stage>` (Prefect fills it in from the
    task's arguments): the steps' tasks share the train flow run, and the UI lists them by
    this name instead of with a random suffix."""
    return f"rollout-{{rollout_id}}/{stage}"


# Transient faults (an engine or actor briefly unreachable) are retried; the record check
# (`run_once`) makes a retry after a partial success safe.
TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE, "retries": 2, "retry_delay_seconds": 2,
                                "retry_condition_fn": retry_transient}
