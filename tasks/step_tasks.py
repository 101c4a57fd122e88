"""The Prefect tasks of one rollout step, in the order the step runs them:

sample_prompts -> generate -> filter -> reward -> train -> broadcast_weights -> commit

Each is thin: it calls into an actor and returns the small typed record (URIs, metrics;
engines/records.py, tasks/records.py) of its stage. A task whose record already exists for
(run, rollout_id, stage) is skipped and returns that record (`run_once`), so re-running a
failed step resumes at the task that failed. `evaluate_version` scores a weight version on
the held-out sets. What each task is handed is in tasks/step_context.py; how they retry in
tasks/retries.py; the step that calls them in order is flows/rollout_step.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ray
from prefect import task

from engines.cluster.actors import RunActors, apply_engine_pool, replace_lost_engines
from engines.config.run import RunConfig
from engines.records import (
    FilterRecord,
    GenerateRecord,
    RewardRecord,
    SamplePromptsRecord,
    StageRecord,
)
from engines.weights.schedule import pushes_weights, required_weight_version
from tasks import colocate
from tasks.artifacts import ProgressArtifact, artifact_key, publish_eval
from tasks.records import BroadcastRecord, StepMetrics, TrainRecord
from tasks.retries import TASK_OPTIONS, step_run_name
from tasks.step_context import StepContext, resolve, run_once


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
        actors, versions = answering_engines(ctx, actors)
        sync_engine_weights(
            actors, required_weight_version(ctx.cfg, rollout_id), ctx.cfg.train.weight_sync,
            versions,
        )
        record = wait_showing_progress(
            ctx, rollout_id, actors.rollout.generate.remote(rollout_id)
        )
        if record.lost_engines:  # the step went on without them; new ones join now
            ctx.actors = replace_lost_engines(ctx.cfg, actors, record.lost_engines)
            if match_survivors(ctx.actors) is None:
                sync_engine_weights(ctx.actors, None, ctx.cfg.train.weight_sync)
        return record

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
def train_step(ctx: StepContext, rollout_id: int) -> TrainRecord:
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


@task(name="broadcast_weights", task_run_name=step_run_name("broadcast_weights"), **TASK_OPTIONS)
def broadcast_weights(ctx: StepContext, rollout_id: int) -> BroadcastRecord:
    # Not recorded: it is cheap and must always leave the engines at the trainer's version.
    start = time.perf_counter()
    actors = ctx.reattach()
    if ctx.cfg.cluster.colocate:
        colocate.resume_engines(actors)
    if not pushes_weights(ctx.cfg, rollout_id):  # train.update_weights_interval
        return BroadcastRecord(engines_updated=0, seconds=time.perf_counter() - start)
    # `rollflow engines add|remove` takes effect at a push: the engines are idle, and a new
    # one gets the version every engine gets now (the trainer holds no older one to give).
    ctx.actors = actors = apply_engine_pool(ctx.cfg, actors)
    actors, versions = answering_engines(ctx, actors)
    record = sync_engine_weights(actors, None, ctx.cfg.train.weight_sync, versions)
    return replace(record, seconds=time.perf_counter() - start)


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
def evaluate_version(ctx: StepContext, weight_version: int) -> dict[str, float]:
    """Held-out metrics of `weight_version` (stored ones if it was evaluated before), also
    shown in the UI as a table (artifact `{run}-eval`)."""
    metrics = ctx.layout.eval_of(weight_version)
    if metrics is None:
        metrics = dict(resolve(ctx.reattach().rollout.evaluate.remote(weight_version)))
    publish_eval(ctx.cfg.storage.run_name, weight_version, metrics)
    return metrics


# --- what the tasks share ---------------------------------------------------

def answering_engines(ctx: StepContext, actors: RunActors) -> tuple[RunActors, list[int]]:
    """(actors, each engine's weight version), an engine that is dead or does not answer
    within `rollout.engine_hang_timeout_s` replaced first: outside generation nothing else
    watches the engines, and a call to a hung one (SIGSTOPped, a stuck GPU) would wait for
    Ray's keep-alive, minutes."""
    refs = [e.weight_version.remote() for e in actors.engines]
    if not refs or not isinstance(refs[0], ray.ObjectRef):  # the fakes of the unit tests
        return actors, list(refs)
    ready, _ = ray.wait(refs, num_returns=len(refs),
                        timeout=ctx.cfg.rollout.engine_hang_timeout_s)
    lost = []
    for url, ref in zip(actors.urls, refs, strict=True):
        try:
            if ref not in ready:
                raise TimeoutError
            ray.get(ref)
        except (TimeoutError, ray.exceptions.ActorDiedError,
                ray.exceptions.ActorUnavailableError):
            lost.append(url)
    if lost:
        ctx.actors = actors = replace_lost_engines(ctx.cfg, actors, lost)
        matched = match_survivors(actors)
        if matched is not None:
            return actors, matched
        refs = [e.weight_version.remote() for e in actors.engines]
    return actors, resolve(refs)


def match_survivors(actors: RunActors) -> list[int] | None:
    """Engines that replaced lost ones take a surviving engine's weights and version, so
    they sample as the lost ones would have: the trainer may already hold newer weights
    (`train.update_weights_interval` > 1, async mode), and pushing those would move every
    engine ahead of the run's schedule. Returns the engines' versions after; None where no
    engine survived or the survivors cannot hand their weights over (then the caller
    pushes the trainer's weights, as before)."""
    versions = resolve([e.weight_version.remote() for e in actors.engines])
    target = max(versions, default=0)
    donors = [e for e, v in zip(actors.engines, versions, strict=True) if v == target]
    behind = [e for e, v in zip(actors.engines, versions, strict=True) if v != target]
    if not behind:
        return versions
    if not resolve(donors[0].exports_weights.remote()):
        return None
    weights_ref = donors[0].weights.remote()  # engine -> object store -> engines
    resolve([e.update_weights_from_tensor.remote(weights_ref, target) for e in behind])
    return [target] * len(versions)


def sync_engine_weights(
    actors: RunActors, min_version: int | None = None, weight_sync: str = "tensor",
    versions: list[int] | None = None,
) -> BroadcastRecord:
    """Push the trainer's weights to every engine that is not at its version. The state
    dict travels trainer -> Ray object store -> engines; the driver only holds the ref.

    `versions`: the engines' weight versions, when the caller already asked them.
    With `min_version`, engines already at or past it are left alone without asking the
    trainer (which, in async mode, may be busy training the previous step). `weight_sync`
    other than "tensor" goes over the engines' HTTP API (process-group broadcast or disk), and
    so does "tensor" when trainer and engines share a GPU: SGLang's CUDA IPC handles.
    """
    engine_versions = versions if versions is not None else resolve(
        [e.weight_version.remote() for e in actors.engines])
    if min_version is not None and engine_versions and min(engine_versions) >= min_version:
        return BroadcastRecord(weight_version=min(engine_versions), engines_updated=0)
    version = resolve(actors.trainer.version.remote())
    stale = [e for e, v in zip(actors.engines, engine_versions, strict=True) if v != version]
    if stale and weight_sync == "tensor" and not resolve(actors.trainer.sends_cuda_ipc.remote()):
        weights_ref = actors.trainer.weights.remote()
        resolve([e.update_weights_from_tensor.remote(weights_ref, version) for e in stale])
    elif stale:
        urls = resolve([e.url.remote() for e in actors.engines])
        resolve(actors.trainer.push_weights.remote(urls))
        timings = getattr(actors.trainer, "push_timings", None)  # (the tests' fakes have none)
        push = resolve(timings.remote()) if timings is not None else {}
        return BroadcastRecord(weight_version=version, engines_updated=len(stale), push=push)
    return BroadcastRecord(weight_version=version, engines_updated=len(stale))


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


def should_checkpoint(cfg: RunConfig, rollout_id: int) -> bool:
    interval = cfg.train.save_interval
    last = rollout_id == cfg.rollout.num_rollout - 1
    return last or (interval is not None and (rollout_id + 1) % interval == 0)
