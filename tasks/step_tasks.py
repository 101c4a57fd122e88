"""The Prefect tasks of one rollout step, in the order the step runs them:

sample_prompts -> generate -> filter -> reward -> train -> broadcast_weights -> commit

Each is thin: it calls one actor or engine-pool method (engines/cluster/engine_pool.py) and
returns the small typed record (URIs, metrics; engines/records.py, tasks/records.py) of its
stage. A task whose record already exists for (run, rollout_id, stage) is skipped and returns
that record (`run_once`), so re-running a failed step resumes at the task that failed.
`evaluate_version` scores a weight version on the held-out sets. What each task is handed is
in tasks/step_context.py; how they retry in tasks/retries.py; the step that calls them in
order is flows/rollout_step.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from prefect import task

from engines.cadence import every_n_steps_or_last
from engines.config.run import RunConfig
from engines.records import (
    BroadcastRecord,
    FilterRecord,
    GenerateRecord,
    RewardRecord,
    SamplePromptsRecord,
    StageRecord,
)
from tasks import colocate
from tasks.artifacts import ProgressArtifact, artifact_key, publish_eval, publish_staleness
from tasks.records import StepMetrics, TrainRecord
from tasks.retries import TASK_OPTIONS, step_run_name
from tasks.step_context import StepContext, run_once


@task(name="sample_prompts", task_run_name=step_run_name("sample_prompts"), **TASK_OPTIONS)
def sample_prompts(ctx: StepContext, rollout_id: int) -> SamplePromptsRecord:
    """The step's prompt groups, the buffer's first, then the dataset's (prompts.arrow)."""
    return run_once(
        ctx.layout, rollout_id, SamplePromptsRecord,
        lambda: ctx.get(ctx.reattach().rollout.sample_prompts.remote(rollout_id)),
    )


@task(name="generate", task_run_name=step_run_name("generate"), **TASK_OPTIONS,
      description="Responses and their rewards (the dynamic filter needs the rewards as each "
      "group finishes); kept groups to rollout.arrow, the rest back to the buffer.")
def generate(ctx: StepContext, rollout_id: int) -> GenerateRecord:
    """The generation loop (engines/rollout/generation.py), on engines brought to the step's
    weight version first; engines it lost on the way are replaced once it is done."""
    def work() -> GenerateRecord:
        actors = ctx.reattach()
        if ctx.cfg.cluster.colocate:
            colocate.enter_rollout_phase(actors)
        ctx.pool.prepare_generation(rollout_id)
        generating = ctx.actors.rollout.generate.remote(rollout_id)
        record = wait_showing_progress(ctx, rollout_id, generating)
        ctx.pool.replace_lost(record.lost_engines)  # the step went on without them
        publish_staleness(ctx.cfg.storage.run_name, rollout_id, record.rollout_metrics)
        return record

    return run_once(ctx.layout, rollout_id, GenerateRecord, work)


@task(name="filter", task_run_name=step_run_name("filter"), **TASK_OPTIONS,
      description="Trims over-sampling: the over-sampling filter orders the generated groups "
      "and the first rollout_batch_size are trained on. Writes no samples.")
def filter_groups(ctx: StepContext, rollout_id: int) -> FilterRecord:
    """Only trims the over-sampling (`rollout.over_sampling_filter_path`, then the first
    `rollout_batch_size` groups; failed groups dropped): the dynamic filter ran in generate."""
    return run_once(
        ctx.layout, rollout_id, FilterRecord,
        lambda: ctx.get(ctx.reattach().rollout.filter.remote(rollout_id)),
    )


@task(name="reward", task_run_name=step_run_name("reward"), **TASK_OPTIONS,
      description="Turns the rewards computed during generate into scalars, masks the samples "
      "the sample filter rejects, and writes the training batch, train.arrow.")
def reward(ctx: StepContext, rollout_id: int, kept_groups: Sequence[int]) -> RewardRecord:
    """Computes no reward: generate did, as each group finished (the dynamic filter needs
    them). This turns them into scalars (`rollout.reward_key`), masks the samples
    `rollout.sample_filter_path` rejects and writes the kept groups as train.arrow."""
    return run_once(
        ctx.layout, rollout_id, RewardRecord,
        lambda: ctx.get(ctx.reattach().rollout.reward.remote(rollout_id, kept_groups)),
    )


@task(name="train", task_run_name=step_run_name("train"), **TASK_OPTIONS)
def train_step(ctx: StepContext, rollout_id: int) -> TrainRecord:
    """Always asks the trainer (its weight version, not the record, is the truth): a trainer
    that lost its state re-trains this step from train.arrow after replaying earlier ones."""
    actors = ctx.reattach()
    if ctx.cfg.cluster.colocate:
        colocate.enter_train_phase(actors)
    started_at, start = time.time(), time.perf_counter()
    metrics = dict(ctx.get(actors.trainer.train_step.remote(rollout_id)))
    saved = ctx.layout.task_record(rollout_id, TrainRecord.STAGE)
    if saved is not None:
        return TrainRecord.from_json(saved).stored()
    record = TrainRecord(metrics=metrics, settings=ctx.settings).timed(
        time.perf_counter() - start, started_at, time.time())
    ctx.layout.save_task_record(rollout_id, TrainRecord.STAGE, record.to_json())
    return record


@task(name="broadcast_weights", task_run_name=step_run_name("broadcast_weights"), **TASK_OPTIONS)
def broadcast_weights(ctx: StepContext, rollout_id: int) -> BroadcastRecord:
    """The trainer's new weights to the engines, on the steps that push. Not recorded: it is
    cheap and must always leave the engines at the trainer's version."""
    start = time.perf_counter()
    actors = ctx.reattach()
    if ctx.cfg.cluster.colocate:
        colocate.resume_engines(actors)
    record = ctx.pool.push_after_step(rollout_id)
    return replace(record, seconds=time.perf_counter() - start)


@task(name="commit", task_run_name=step_run_name("commit"), **TASK_OPTIONS)
def commit(
    ctx: StepContext, rollout_id: int, records: Sequence[StageRecord]
) -> dict[str, Any]:
    """Metrics (every stage record's to_metrics(), in stage order), a periodic checkpoint,
    then the COMMITTED marker (always last). Returns metrics.json's content."""
    start = time.perf_counter()
    checkpoint = save_checkpoint_if_due(ctx, rollout_id)
    metrics = StepMetrics(rollout_id, records, checkpoint,
                          commit_seconds=time.perf_counter() - start).to_json()
    ctx.layout.store.write_json(metrics, f"steps/{rollout_id:06d}", "metrics.json")
    ctx.layout.mark_committed(rollout_id)
    return metrics


@task(name="evaluate", task_run_name="evaluate", **TASK_OPTIONS)
def evaluate_version(ctx: StepContext, weight_version: int) -> dict[str, float]:
    """Held-out metrics of `weight_version` (stored ones if it was evaluated before), also
    shown in the UI as a table (artifact `{run}-eval`)."""
    metrics = ctx.layout.eval_of(weight_version)
    if metrics is None:
        metrics = dict(ctx.get(ctx.reattach().rollout.evaluate.remote(weight_version)))
    publish_eval(ctx.cfg.storage.run_name, weight_version, metrics)
    return metrics


# --- what the tasks share ---------------------------------------------------

def wait_showing_progress(ctx: StepContext, rollout_id: int, ref: Any) -> GenerateRecord:
    """ctx.get(ref), meanwhile mirroring the actor's progress file into a Prefect progress
    artifact, so the UI shows how far generation is (groups kept / target)."""
    parts = (f"steps/{rollout_id:06d}", "generate.progress.json")
    bar = ProgressArtifact(artifact_key(ctx.cfg.storage.run_name, "generation"),
                           f"step {rollout_id}: groups kept / rollout_batch_size")
    while not ctx.replies.answered([ref], 0.5)[0]:
        if ctx.layout.store.exists(*parts):
            p = ctx.layout.store.read_json(*parts)
            # over-sampling keeps more groups than the target before trimming to it
            bar.set(100.0 * min(p["kept"] / max(p["target"], 1), 1.0))
    result: GenerateRecord = ctx.get(ref)
    if ctx.layout.store.exists(*parts):  # also when it finished before the first poll
        bar.set(100.0)
    return result


def save_checkpoint_if_due(ctx: StepContext, rollout_id: int) -> str | None:
    """A checkpoint of the weights step `rollout_id` trained (the trainer brought to them
    first), on the steps `should_checkpoint` names; None on the others."""
    if not should_checkpoint(ctx.cfg, rollout_id):
        return None
    trainer = ctx.reattach().trainer
    ctx.get(trainer.ensure_version.remote(rollout_id + 1))
    uri: str = ctx.get(trainer.save_checkpoint.remote(rollout_id))
    return uri


def should_checkpoint(cfg: RunConfig, rollout_id: int) -> bool:
    """Every `train.save_interval` steps and after the last (None: only the last)."""
    return every_n_steps_or_last(rollout_id, cfg.train.save_interval, cfg.rollout.num_rollout)
