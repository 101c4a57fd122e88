"""The train flow and its loop: one rollout step per rollout_id, resuming where the run
left off. The step itself (its seven tasks in order) is flows/rollout_step.py.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import ray
from prefect import flow
from prefect.states import Cancelled

from engines.cluster.actors import get_or_create_actors, kill_run_actors
from engines.cluster.head import cluster_address, connect
from engines.process import long_lived_frozen
from engines.weights.schedule import evaluates_after
from flows.bookkeeping.driver_record import (
    RunInUseError,
    current_flow_run_id,
    mark_ended,
    take_over,
)
from flows.bookkeeping.failure_notice import notify_failure
from flows.bookkeeping.head_watch import exiting_if_head_is_lost
from flows.bookkeeping.labels import labelled
from flows.bookkeeping.metric_sinks import open_sinks
from flows.bookkeeping.preflight import PreflightReport, preflight_once
from flows.bookkeeping.reporting import artifact_key, publish_run_report
from flows.bookkeeping.run_status import headline_metric
from flows.bookkeeping.start_lines import phase, stop_telling
from flows.config.history import warn_if_replayed_under_changed_config
from flows.config.loader import dump_config
from flows.config.paths import resolve_paths
from flows.config.run import RollflowConfig
from flows.config.storage_credentials import with_storage_credentials
from flows.rollout_step import open_layout, rollout_step
from flows.step_flow_runs import step_flow_runs
from storage.run_layout import ACTORS_KEPT, RunLayout
from storage.secrets import register
from storage.step_signals import step_state_written, wait_for
from tasks.artifact_sender import artifacts_in_background
from tasks.artifacts import ProgressArtifact
from tasks.step_context import StepContext
from tasks.step_tasks import evaluate_version


@flow(name="train", flow_run_name="train-{config.storage.run_name}", persist_result=False,
      on_failure=[notify_failure])
def train(config: RollflowConfig) -> dict[str, Any]:
    register(config.secret_values())  # deployments pass the config without the CLI
    config = with_storage_credentials(resolve_paths(config))  # (registers the merged ones)
    # tags run/algo/backends on this run and all it starts; artifacts sent off the steps' path
    with labelled(config), artifacts_in_background():
        return run_training(config)


def run_training(config: RollflowConfig) -> dict[str, Any]:
    """Attach the run's actors, resume at its first uncommitted step, run every step (with
    evaluations on schedule), then release the actors."""
    checked = preflight_once(config)
    layout = open_layout(config)
    try:
        take_over(layout, layout.uri, current_flow_run_id())
    except RunInUseError as busy:
        # A second driver (a schedule firing while the last training still runs): this flow
        # run did nothing and ends Cancelled, saying why; calling it still raises `busy`.
        return Cancelled(message=str(busy), data=busy)  # type: ignore[return-value]
    try:
        if finished(config, layout):
            save_config(layout, config)
            free_kept_actors(config, layout)
            return _result(config, layout, checked, config.rollout.num_rollout, restored=None)
        phase("Ray: connecting to the head (a local one starts if none is running)")
        with exiting_if_head_is_lost(connect(config.cluster), config.storage.run_name):
            return train_attached(config, layout, checked)
    finally:
        mark_ended(layout)


def train_attached(config: RollflowConfig, layout: RunLayout,
                   checked: PreflightReport) -> dict[str, Any]:
    """The run on the cluster this process is attached to: its actors, its remaining steps
    and evaluations, then the actors released."""
    ctx, start, restored = start_run(config, layout)
    save_config(layout, config)  # (once it started: a config that cannot start is no history)
    warn_if_replayed_under_changed_config(restored, layout, config)
    # A trainer already past `start` (it trained that step, the driver died before recording
    # it) put its newer weights on the engines: they are not version `start`'s to evaluate.
    if config.eval.enabled and config.eval.before_train and restored["version"] <= start:
        evaluate_version(ctx, start)

    pipelined = config.rollout.overlaps_steps
    phase(f"step {start}: starting ({config.rollout.num_rollout - start} to go)")
    stop_telling()  # the progress bar and the step lines take over
    reporter = StepReporter(config, layout, start)

    def step_done(rollout_id: int, metrics: dict[str, Any]) -> None:
        reporter.log(rollout_id, metrics)
        if evaluates_after(config, rollout_id) and not pipelined:  # (async: in the step)
            evaluate_version(ctx, rollout_id + 1)

    try:
        # no full GC pause of Prefect's, Ray's, torch's heap in a step
        with long_lived_frozen(), step_flow_runs(rollout_step, config) as steps:
            (run_pipelined if pipelined else run_sequential)(ctx, start, steps.run, step_done)
    finally:
        reporter.close()  # a failure's first line must not run on from the progress bar
    if config.eval.enabled:
        evaluate_version(ctx, config.rollout.num_rollout)
    result = _result(config, layout, checked, start, restored)
    release_actors(config, layout)
    return result


StepDone = Callable[[int, dict[str, Any]], None]
RunStep = Callable[[StepContext, int], dict[str, Any]]


def run_sequential(ctx: StepContext, start: int, run_step: RunStep, done: StepDone) -> None:
    """Synchronous: one step after the other."""
    for rollout_id in range(start, ctx.cfg.rollout.num_rollout):
        done(rollout_id, run_step(ctx, rollout_id))


def run_pipelined(ctx: StepContext, start: int, run_step: RunStep, done: StepDone) -> None:
    """One-step off-policy: step k+1 starts once step k's generation is committed (the data
    source state it draws from), so its generation overlaps step k's training; gates in
    tasks/step_gates.py keep the order of weights. Each step runs in its own thread, in
    this flow run (or as a child flow run of it)."""
    config, layout = ctx.cfg, ctx.layout
    total = config.rollout.num_rollout
    in_flight: dict[int, Future[dict[str, Any]]] = {}
    reported = start
    with ThreadPoolExecutor(max_workers=3 + config.rollout.max_staleness) as pool:
        for rollout_id in range(start, total):
            context = contextvars.copy_context()
            future = pool.submit(context.run, run_step, ctx, rollout_id)
            future.add_done_callback(lambda _: step_state_written())
            in_flight[rollout_id] = future
            wait_for(partial(_generated_or_done, layout, rollout_id, future), float("inf"))
            if future.done() and future.exception() is not None:
                break
            while reported in in_flight and in_flight[reported].done():
                done(reported, in_flight[reported].result())
                reported += 1
        for rollout_id in range(reported, start + len(in_flight)):
            done(rollout_id, in_flight[rollout_id].result())  # re-raises the first failure


def _generated_or_done(layout: RunLayout, rollout_id: int, future: Future[Any]) -> bool:
    """Step `rollout_id` committed its generation (the next step may start), or ended."""
    return future.done() or layout.task_record(rollout_id, "generate") is not None


def start_run(config: RollflowConfig, layout: RunLayout) -> tuple[StepContext, int, Any]:
    """Actors attached (or created) and the trainer at the version the run resumes from.
    A run that fails here tears its actors down: there is nothing warm worth keeping, and
    they would hold the machine's memory until `rollflow cluster down`."""
    phase(f"actors: attaching the run's trainer and {config.engine.num_engines} engine(s), "
          "starting those not running")
    try:
        ctx = StepContext(config, layout, get_or_create_actors(config))
        ctx.save_settings()
        start = layout.next_rollout_id()
        restored = ray.get(ctx.actors.trainer.ensure_version.remote(start))
        ctx.pool.sync_weights()
    except BaseException:
        kill_run_actors(config)
        raise
    return ctx, start, restored


def finished(config: RollflowConfig, layout: RunLayout) -> bool:
    """Every step committed and, if the run evaluates, its last version's metrics stored:
    a rerun has nothing to compute. It then starts no actors: loading models it would not
    use would make a rerun of a finished job cost as much as its start."""
    total = config.rollout.num_rollout
    if layout.next_rollout_id() < total:
        return False
    return not config.eval.enabled or layout.has_eval(total)


def release_actors(config: RollflowConfig, layout: RunLayout) -> None:
    """The end of a run: its actors stay warm for the next run (keep_actors), or go."""
    if config.cluster.keep_actors:
        layout.store.write_text("", ACTORS_KEPT)
        return
    kill_run_actors(config)
    layout.store.delete(ACTORS_KEPT)  # (if there)


def free_kept_actors(config: RollflowConfig, layout: RunLayout) -> None:
    """A finished run rerun without keep_actors frees the actors an earlier run kept."""
    if config.cluster.keep_actors or not layout.store.exists(ACTORS_KEPT):
        return
    if cluster_address(config.cluster, start=False) is not None:  # (none: they went with it)
        connect(config.cluster)
        kill_run_actors(config)
    layout.store.delete(ACTORS_KEPT)


def save_config(layout: RunLayout, config: RollflowConfig) -> None:
    """config.yaml is the config the run goes on with; a rerun with a changed config keeps
    the one it replaces as configs/<n>.yaml, so the run directory tells its whole story."""
    text = dump_config(config)
    if layout.store.exists("config.yaml"):
        old = layout.store.read_text("config.yaml")
        if old == text:
            return
        n = len(layout.store.list("configs"))
        layout.store.write_text(old, "configs", f"{n:03d}.yaml")
    layout.store.write_text(text, "config.yaml")


class StepReporter:
    """Where a committed step's metrics go: the metric sinks (`logging.sinks`), the progress
    bar, and the progress artifact the Prefect UI shows."""

    def __init__(self, config: RollflowConfig, layout: RunLayout, start: int) -> None:
        self.total = config.rollout.num_rollout
        self.progress = ProgressArtifact(artifact_key(config.storage.run_name, "steps"),
                                         "rollout steps committed")
        self.progress.set(100.0 * start / self.total)
        self.bar = _progress_bar(config, start)
        self.headline = headline_metric(config.algorithm.loss_type)
        self.sinks = open_sinks(config.logging, layout, config.storage.run_name)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self.sinks.log(metrics, step=rollout_id)
        self.bar.update(1)
        self.bar.set_postfix({k: f"{metrics[k]:.3f}" for k in (self.headline,) if k in metrics})
        self.progress.set(100.0 * (rollout_id + 1) / self.total)

    def close(self) -> None:
        self.sinks.close()
        self.bar.close()


def _progress_bar(cfg: RollflowConfig, start: int) -> Any:
    from tqdm.auto import tqdm

    total = cfg.rollout.num_rollout
    return tqdm(total=total, initial=start, desc="rollout steps", disable=not cfg.logging.progress)


def _result(
    config: RollflowConfig, layout: RunLayout, checked: PreflightReport, start: int,
    restored: Any,
) -> dict[str, Any]:
    """What train() returns, with the run's report published (tables, curves)."""
    report = publish_run_report(layout, make_plot=config.logging.plot)
    return {"run_dir": layout.uri, "resumed_at": start, "restored": restored,
            "prompts": checked.prompts, "prompts_dropped_too_long": checked.dropped_too_long,
            **report}
