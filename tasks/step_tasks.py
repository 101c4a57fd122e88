"""The Prefect tasks of one rollout step. Each is thin: it calls into an actor and returns
the small typed record (URIs, metrics; engines/records.py, tasks/records.py) of the stage.

A task whose record already exists for (run, rollout_id, task) is skipped and returns that
record, so re-running a failed step resumes at the task that failed.

Actors are called as `resolve(actor.method.remote(...))`: `resolve` is `ray.get` for object
refs and hands anything else back as it is, so the tasks' logic runs in unit tests with the
fake actors of tests/fakes.py, whose `.remote()` returns the value itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from engines.cluster.actors import RunActors, get_or_create_actors
from engines.data.prompt_dataset import DatasetError
from engines.hooks.loader import HookError
from engines.records import (
    FilterRecord,
    GenerateRecord,
    RewardRecord,
    SamplePromptsRecord,
    StageRecord,
)
from engines.rollout.rewards.hub import RewardConfigError
from engines.run_config import RunConfig as RollflowConfig
from engines.train.finite import NonFiniteError
from engines.train.lora import LoraResumeError
from engines.train.step_settings import StepSettings
from engines.weights.schedule import pushes_weights, required_weight_version
from storage.integrity import CorruptFileError
from storage.run_layout import RunLayout
from storage.sample import RewardError
from tasks import colocate
from tasks.artifacts import ProgressArtifact, artifact_key, publish_eval
from tasks.records import BroadcastRecord, StepMetrics, TrainRecord


class StepContext:
    """What every task of a step needs: the config, where the run lives, the actors.

    A plain class, not a dataclass: Prefect walks a dataclass (or pydantic) task argument
    field by field, the whole config included, looking for futures to resolve and upstream
    runs to draw, twice per task (~170 objects each time, ~2 ms of a task's start)."""

    __slots__ = ("actors", "cfg", "layout", "settings")

    def __init__(self, cfg: RollflowConfig, layout: RunLayout, actors: RunActors) -> None:
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
        up again costs ~0.1 s per task (0.4 s of a mock step)."""
        task_run = TaskRunContext.get()
        if task_run is None or task_run.task_run.run_count <= 1:  # None: called as .fn()
            return self.actors
        self.actors = get_or_create_actors(self.cfg)
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


# Failures that come out the same however often they are retried: a bad input or a
# corrupt file (fix it and rerun) is reported at once instead of after two retries.
DETERMINISTIC: tuple[type[BaseException], ...] = (
    CorruptFileError, DatasetError, HookError, LoraResumeError, NonFiniteError,
    RewardConfigError, RewardError,
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


# Transient faults (an engine or actor briefly unreachable) are retried; the record check
# makes a retry after a partial success safe.
def step_run_name(stage: str) -> str:
    """A step task's run name, `rollout-{rollout_id}/<stage>` (Prefect fills it in from the
    task's arguments): the steps' tasks share the train flow run, and the UI lists them by
    this name instead of with a random suffix."""
    return f"rollout-{{rollout_id}}/{stage}"


TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE, "retries": 2, "retry_delay_seconds": 2,
                                "retry_condition_fn": retry_transient}


def wait_showing_progress(ctx: StepContext, rollout_id: int, ref: Any) -> GenerateRecord:
    """resolve(ref), meanwhile mirroring the actor's progress file into a Prefect progress
    artifact, so the UI shows how far generation is (groups kept / target)."""
    parts = (f"steps/{rollout_id:06d}", "generate.progress.json")
    bar = ProgressArtifact(artifact_key(ctx.cfg.storage.run_name, "generation"),
                           f"step {rollout_id}: groups kept / rollout_batch_size")
    while isinstance(ref, ray.ObjectRef) and not ray.wait([ref], timeout=0.5)[0]:
        if ctx.layout.store.exists(*parts):
            p = ctx.layout.store.read_json(*parts)
            # over-sampling keeps more groups than the target before trimming to it
            bar.set(100.0 * min(p["kept"] / max(p["target"], 1), 1.0))
    result: GenerateRecord = resolve(ref)
    if ctx.layout.store.exists(*parts):  # also when it finished before the first poll
        bar.set(100.0)
    return result


@task(name="sample_prompts", task_run_name=step_run_name("sample_prompts"), **TASK_OPTIONS)
def sample_prompts(ctx: StepContext, rollout_id: int) -> SamplePromptsRecord:
    return run_once(
        ctx.layout, rollout_id, SamplePromptsRecord,
        lambda: resolve(ctx.reattach().rollout.sample_prompts.remote(rollout_id)),
    )


@task(name="generate", task_run_name=step_run_name("generate"), **TASK_OPTIONS)
def generate(ctx: StepContext, rollout_id: int) -> GenerateRecord:
    def work() -> GenerateRecord:
        actors = ctx.reattach()
        if ctx.cfg.cluster.colocate:
            colocate.enter_rollout_phase(actors)
        # A restarted engine comes back with the initial weights: bring it up to date.
        sync_engine_weights(
            actors, required_weight_version(ctx.cfg, rollout_id), ctx.cfg.train.weight_sync
        )
        return wait_showing_progress(
            ctx, rollout_id, actors.rollout.generate.remote(rollout_id)
        )

    return run_once(ctx.layout, rollout_id, GenerateRecord, work)


@task(name="filter", task_run_name=step_run_name("filter"), **TASK_OPTIONS)
def filter_groups(ctx: StepContext, rollout_id: int) -> FilterRecord:
    return run_once(
        ctx.layout, rollout_id, FilterRecord,
        lambda: resolve(ctx.reattach().rollout.filter.remote(rollout_id)),
    )


@task(name="reward", task_run_name=step_run_name("reward"), **TASK_OPTIONS)
def reward(ctx: StepContext, rollout_id: int, kept_groups: Sequence[int]) -> RewardRecord:
    return run_once(
        ctx.layout, rollout_id, RewardRecord,
        lambda: resolve(ctx.reattach().rollout.reward.remote(rollout_id, kept_groups)),
    )


@task(name="train", task_run_name=step_run_name("train"), **TASK_OPTIONS)
def train(ctx: StepContext, rollout_id: int) -> TrainRecord:
    """Always asks the trainer (its weight version, not the record, is the truth): a trainer
    that lost its state re-trains this step from train.arrow after replaying earlier ones."""
    actors = ctx.reattach()
    if ctx.cfg.cluster.colocate:
        colocate.enter_train_phase(actors)
    started_at, start = time.time(), time.perf_counter()
    metrics = dict(resolve(actors.trainer.train_step.remote(rollout_id)))
    saved = ctx.layout.task_record(rollout_id, TrainRecord.STAGE)
    if saved is not None:
        return TrainRecord.from_json(saved).stored()
    record = TrainRecord(metrics=metrics, settings=ctx.settings).timed(
        time.perf_counter() - start, started_at, time.time())
    ctx.layout.save_task_record(rollout_id, TrainRecord.STAGE, record.to_json())
    return record


def sync_engine_weights(
    actors: RunActors, min_version: int | None = None, weight_sync: str = "tensor"
) -> BroadcastRecord:
    """Push the trainer's weights to every engine that is not at its version. The state
    dict travels trainer -> Ray object store -> engines; the driver only holds the ref.

    With `min_version`, engines already at or past it are left alone without asking the
    trainer (which, in async mode, may be busy training the previous step). `weight_sync`
    other than "tensor" goes over the engines' HTTP API (process-group broadcast or disk).
    """
    engine_versions = resolve([e.weight_version.remote() for e in actors.engines])
    if min_version is not None and engine_versions and min(engine_versions) >= min_version:
        return BroadcastRecord(weight_version=min(engine_versions), engines_updated=0)
    version = resolve(actors.trainer.version.remote())
    stale = [e for e, v in zip(actors.engines, engine_versions, strict=True) if v != version]
    if stale and weight_sync == "tensor":
        weights_ref = actors.trainer.weights.remote()
        resolve([e.update_weights_from_tensor.remote(weights_ref, version) for e in stale])
    elif stale:
        urls = resolve([e.url.remote() for e in actors.engines])
        resolve(actors.trainer.push_weights.remote(urls))
    return BroadcastRecord(weight_version=version, engines_updated=len(stale))


@task(name="broadcast_weights", task_run_name=step_run_name("broadcast_weights"), **TASK_OPTIONS)
def broadcast_weights(ctx: StepContext, rollout_id: int) -> BroadcastRecord:
    # Not recorded: it is cheap and must always leave the engines at the trainer's version.
    start = time.perf_counter()
    actors = ctx.reattach()
    if ctx.cfg.cluster.colocate:
        colocate.resume_engines(actors)
    if not pushes_weights(ctx.cfg, rollout_id):  # train.update_weights_interval
        return BroadcastRecord(engines_updated=0, seconds=time.perf_counter() - start)
    record = sync_engine_weights(actors, weight_sync=ctx.cfg.train.weight_sync)
    return replace(record, seconds=time.perf_counter() - start)


def should_checkpoint(cfg: RollflowConfig, rollout_id: int) -> bool:
    interval = cfg.train.save_interval
    last = rollout_id == cfg.rollout.num_rollout - 1
    return last or (interval is not None and (rollout_id + 1) % interval == 0)


@task(name="commit", task_run_name=step_run_name("commit"), **TASK_OPTIONS)
def commit(
    ctx: StepContext, rollout_id: int, records: Sequence[StageRecord]
) -> dict[str, Any]:
    """Metrics (every stage record's to_metrics(), in stage order), a periodic checkpoint,
    then the COMMITTED marker (always last). Returns metrics.json's content."""
    start = time.perf_counter()
    checkpoint: str | None = None
    if should_checkpoint(ctx.cfg, rollout_id):
        trainer = ctx.reattach().trainer
        resolve(trainer.ensure_version.remote(rollout_id + 1))
        checkpoint = resolve(trainer.save_checkpoint.remote(rollout_id))
    metrics = StepMetrics(rollout_id, records, checkpoint,
                          commit_seconds=time.perf_counter() - start).to_json()
    ctx.layout.store.write_json(metrics, f"steps/{rollout_id:06d}", "metrics.json")
    ctx.layout.mark_committed(rollout_id)
    return metrics


@task(name="evaluate", task_run_name="evaluate", **TASK_OPTIONS)
def evaluate(ctx: StepContext, weight_version: int) -> dict[str, float]:
    """Held-out metrics of `weight_version` (stored ones if it was evaluated before), also
    shown in the UI as a table (artifact `{run}-eval`)."""
    metrics = ctx.layout.eval_of(weight_version)
    if metrics is None:
        metrics = dict(resolve(ctx.reattach().rollout.evaluate.remote(weight_version)))
    publish_eval(ctx.cfg.storage.run_name, weight_version, metrics)
    return metrics
