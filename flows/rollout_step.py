"""One rollout step: `run_step` runs its seven tasks in order, in the train flow run or in
the flow `rollout_step`, a flow run of its own per step.

sample_prompts -> generate -> filter -> reward -> train -> broadcast_weights -> commit

Rewards are computed inside generate, as each group finishes (the dynamic filter needs
them); reward turns them into the scalars train.arrow holds. The tasks themselves are in
tasks/step_tasks.py. Each task waits for the one before it (`wait_for`), so the Prefect UI
draws that chain. By default each step is a child flow run `{run}/rollout-{id}` that groups
its tasks in the UI, created ahead by flows/step_flow_runs.py, at a cost per step measured by
`python -m bench.prefect_floor` (bench/RESULTS.md, "Prefect floor"); with
`logging.step_flow_runs: false` the tasks run in the train flow run, named
`rollout-{id}/<task>`. Either way a failed step resumes at the task that failed (each task's
record in storage) and its tasks retry alike.

In one_step and async modes (`rollout.mode`) gates between them let consecutive steps
overlap; see tasks/step_gates.py for the picture.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, cast

from prefect import State, flow
from prefect.utilities.annotations import quote

from engines.cadence import every_n_steps_or_last
from engines.cluster.actors import attached_actors
from engines.cluster.head import connect
from engines.weights.schedule import evaluates_after
from flows.bookkeeping.reporting import publish_step_report
from flows.bookkeeping.root_cause import summarize
from flows.config.run import RollflowConfig
from flows.prefect_workarounds import results_linked_within_step, untagged_tasks
from flows.step_flow_runs import DRIVER, CommitHook
from storage.object_store import StorageError
from storage.run_layout import RunLayout
from tasks import step_gates as gates
from tasks.step_context import StepContext
from tasks.step_tasks import (
    broadcast_weights,
    commit,
    evaluate_version,
    filter_groups,
    generate,
    reward,
    sample_prompts,
    train_step,
)


def run_step(
    ctx: StepContext, rollout_id: int, on_commit: CommitHook | None = None
) -> dict[str, Any]:
    """Run (or finish) step `rollout_id` in the current flow run; a committed step returns its
    metrics untouched. A failure is marked in storage (the failure notice names the step and
    task) and raised. `on_commit` gets the metrics as soon as the step is committed, before
    its report.

    Each task `wait_for`s the one before (in async mode with the gates of
    tasks/step_gates.py between them): Prefect draws a task's edges from its inputs, and
    without them every record would be drawn as feeding `commit` (which gets the records
    `quote`d, so only broadcast_weights -> commit is drawn)."""
    layout, pipelined = ctx.layout, ctx.cfg.rollout.overlaps_steps
    if layout.is_committed(rollout_id):
        return _committed(layout, rollout_id, on_commit)
    layout.clear_failure(rollout_id)
    # the flow run keeps its tags (flows/bookkeeping/labels.py); links stay within the step
    with _failure_marked(layout, rollout_id), untagged_tasks(), results_linked_within_step():
        # the buffer's groups first, then the dataset's
        sampled = sample_prompts(ctx, rollout_id)
        before: Any = sampled
        if pipelined:
            before = _gate(gates.wait_for_weights, layout, ctx.cfg, rollout_id, after=sampled)
        # responses, and each group's rewards as it finishes (the dynamic filter needs them)
        generated = generate(ctx, rollout_id, wait_for=[before])
        # trims the over-sampling to rollout_batch_size groups
        filtered = filter_groups(ctx, rollout_id, wait_for=[generated])
        # the rewards generate computed, as scalars; sample filter; writes train.arrow
        rewarded = reward(ctx, rollout_id, filtered.kept_groups, wait_for=[filtered])
        before = rewarded
        if pipelined:
            before = _gate(gates.wait_for_previous_commit, layout, rollout_id, after=rewarded)
        trained = train_step(ctx, rollout_id, wait_for=[before])
        before = trained
        if pipelined and ctx.cfg.rollout.mode == "one_step":  # (async: weights change mid-generate)
            before = _gate(gates.wait_for_next_generate, layout, ctx.cfg, rollout_id,
                           after=trained)
        # the engine pool pushes the new weights on the steps that push
        pushed = broadcast_weights(ctx, rollout_id, wait_for=[before])
        before = pushed
        if pipelined and evaluates_after(ctx.cfg, rollout_id):  # see tasks/step_gates.py
            before = evaluate_version(ctx, rollout_id + 1, wait_for=[pushed])
        records = [sampled, generated, filtered, rewarded, trained, pushed]
        metrics: dict[str, Any] = commit(ctx, rollout_id, quote(records), wait_for=[before])
    if on_commit is not None:
        on_commit(metrics)
    publish_step_report(layout, rollout_id, metrics,
                        make_plot=plots_curves(config_of(ctx), rollout_id))
    return metrics


def _committed(
    layout: RunLayout, rollout_id: int, on_commit: CommitHook | None
) -> dict[str, Any]:
    metrics = layout.step_metrics(rollout_id)
    if on_commit is not None:
        on_commit(metrics)
    return metrics


@contextmanager
def _failure_marked(layout: RunLayout, rollout_id: int) -> Iterator[None]:
    """A failure of the step is marked in storage before it is raised."""
    try:
        yield
    except BaseException as e:
        # (a store that failed the step may still be down: then its own error is the cause)
        with suppress(StorageError):
            layout.mark_failed(rollout_id, repr(e), summarize(e),
                               interrupted=not isinstance(e, Exception))
        raise


def config_of(ctx: StepContext) -> RollflowConfig:
    """The whole config of a context the flows made (tasks see it as engines' `RunConfig`)."""
    return cast(RollflowConfig, ctx.cfg)


@flow(name="rollout_step", flow_run_name="{config.storage.run_name}/rollout-{rollout_id}",
      persist_result=False)
def rollout_step(config: RollflowConfig, rollout_id: int) -> dict[str, Any]:
    """Run (or finish) step `rollout_id` as a flow run of its own: with the driver's actors
    when the train flow started it in-process (flows/step_flow_runs.py), else attached to the
    run's actors."""
    driver = DRIVER.get()
    if driver is not None:
        return run_step(driver.ctx, rollout_id, on_commit=driver.on_commit)
    connect(config.cluster)
    layout = open_layout(config)
    if layout.is_committed(rollout_id):
        return layout.step_metrics(rollout_id)
    return run_step(StepContext(config, layout, attached_actors(config)), rollout_id)


def open_layout(cfg: RollflowConfig) -> RunLayout:
    s = cfg.storage
    return RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.store_options())


def plots_curves(cfg: RollflowConfig, rollout_id: int) -> bool:
    """Every `logging.plot_interval` steps and at the last (None: never here): a plot every
    step would cost more than the step's bookkeeping (bench/RESULTS.md, "Orchestration")."""
    interval = cfg.logging.plot_interval
    if not cfg.logging.plot or interval is None:
        return False
    return every_n_steps_or_last(rollout_id, interval, cfg.rollout.num_rollout)


def _gate(gate: Any, *args: Any, after: Any) -> State[Any]:
    """Run a gate task after `after`; its State is what the next task waits for (a gate
    returns seconds waited, and equal floats would be ambiguous upstream links)."""
    state: State[Any] = gate(*args, wait_for=[after], return_state=True)
    state.result()  # a gate that failed (upstream step failed, timeout) raises here
    return state
