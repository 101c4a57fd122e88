"""One rollout step: its seven tasks in order, in the train flow run or in a flow run of its
own.

sample_prompts -> generate -> filter -> reward -> train -> broadcast_weights -> commit

`run_stages` (first below) is the step; the tasks themselves are in tasks/step_tasks.py.
Each task waits for the one before it (`wait_for`), so the Prefect UI draws that chain. By
default the tasks run in the train flow run, named `rollout-{id}/<task>`; with
`logging.step_flow_runs` each step is a child flow run `{run}/rollout-{id}` that groups them
in the UI, at a cost per step measured by `python -m bench.prefect_floor` (bench/RESULTS.md,
"Prefect floor"). Either way a failed step resumes at the task that failed (each task's
record in storage) and its tasks retry alike.

In async mode (`rollout.off_policy_async`) gates between them let two consecutive steps
overlap; see tasks/step_gates.py for the picture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, cast

from prefect import State, flow
from prefect.utilities.annotations import quote

from engines.cluster.actors import attached_actors
from engines.cluster.head import connect
from engines.weights.schedule import evaluates_after
from flows.bookkeeping.reporting import publish_step_report
from flows.config.run import RollflowConfig
from flows.prefect_workarounds import results_linked_within_step, untagged_tasks
from flows.step_flow_runs import DRIVER, CommitHook, step_flow_runs
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


def run_stages(ctx: StepContext, rollout_id: int) -> dict[str, Any]:
    """The step's seven tasks in order, each `wait_for` the one before (in async mode with
    the gates of tasks/step_gates.py between them): Prefect draws a task's edges
    from its inputs, and without them every record would be drawn as feeding `commit`
    (which gets the records `quote`d, so only broadcast_weights -> commit is drawn)."""
    pipelined = ctx.cfg.rollout.off_policy_async
    sampled = sample_prompts(ctx, rollout_id)
    before: Any = sampled
    if pipelined:
        before = _gate(gates.wait_for_weights, ctx.layout, ctx.cfg, rollout_id, after=sampled)
    generated = generate(ctx, rollout_id, wait_for=[before])
    filtered = filter_groups(ctx, rollout_id, wait_for=[generated])
    rewarded = reward(ctx, rollout_id, filtered.kept_groups, wait_for=[filtered])
    before = rewarded
    if pipelined:
        before = _gate(gates.wait_for_previous_commit, ctx.layout, rollout_id, after=rewarded)
    trained = train_step(ctx, rollout_id, wait_for=[before])
    before = trained
    if pipelined:
        before = _gate(gates.wait_for_next_generate, ctx.layout, ctx.cfg, rollout_id, after=trained)
    pushed = broadcast_weights(ctx, rollout_id, wait_for=[before])
    before = pushed
    if pipelined and evaluates_after(ctx.cfg, rollout_id):  # see tasks/step_gates.py
        before = evaluate_version(ctx, rollout_id + 1, wait_for=[pushed])
    records = [sampled, generated, filtered, rewarded, trained, pushed]
    return commit(ctx, rollout_id, quote(records), wait_for=[before])


def run_step_tasks(
    ctx: StepContext, rollout_id: int, on_commit: CommitHook | None = None
) -> dict[str, Any]:
    """Run (or finish) step `rollout_id`; a committed step returns its metrics untouched.
    A failure is marked in storage (the failure notice names the step and task) and raised.
    `on_commit` gets the metrics as soon as the step is committed, before its report."""
    layout = ctx.layout
    if layout.is_committed(rollout_id):
        metrics = layout.step_metrics(rollout_id)
        if on_commit is not None:
            on_commit(metrics)
        return metrics
    layout.clear_failure(rollout_id)
    try:
        # the flow run keeps its tags (flows/bookkeeping/labels.py); links stay within the step
        with untagged_tasks(), results_linked_within_step():
            metrics = run_stages(ctx, rollout_id)
    except BaseException as e:
        # (a store that failed the step may still be down: then its own error is the cause)
        with suppress(StorageError):
            layout.mark_failed(rollout_id, repr(e))
        raise
    if on_commit is not None:
        on_commit(metrics)
    publish_step_report(layout, rollout_id, metrics, make_plot=plots_curves(config_of(ctx), rollout_id))
    return metrics


def run_rollout_step(ctx: StepContext, rollout_id: int) -> dict[str, Any]:
    """Step `rollout_id` on its own, the way `step_runner` runs each step of a training."""
    with step_runner(config_of(ctx), total_steps=rollout_id + 1) as run_step:
        return run_step(ctx, rollout_id)


StepRunner = Callable[[StepContext, int], dict[str, Any]]


@contextmanager
def step_runner(config: RollflowConfig, total_steps: int | None = None) -> Iterator[StepRunner]:
    """How the train flow runs each step of a run: in a flow run of its own, created one step
    ahead (the default; none past `total_steps`, the run's length unless given), or its tasks
    in the train flow run (`logging.step_flow_runs: false`)."""
    if not steps_are_flow_runs(config):
        yield run_step_tasks
        return
    total = config.rollout.num_rollout if total_steps is None else total_steps
    with step_flow_runs(prenamed_rollout_step, total) as flow_runs:
        yield flow_runs.run


def config_of(ctx: StepContext) -> RollflowConfig:
    """The whole config of a context the flows made (tasks see it as engines' `RunConfig`)."""
    return cast(RollflowConfig, ctx.cfg)


def _rollout_step(config: RollflowConfig, rollout_id: int) -> dict[str, Any]:
    """Run (or finish) step `rollout_id` as a flow run of its own: with the driver's actors
    when the train flow started it in-process, else attached to the run's actors."""
    driver = DRIVER.get()
    if driver is None:
        connect(config.cluster)
        layout = open_layout(config)
        if layout.is_committed(rollout_id):
            return layout.step_metrics(rollout_id)
        return run_step_tasks(StepContext(config, layout, attached_actors(config)), rollout_id)
    return run_step_tasks(driver.ctx, rollout_id, on_commit=driver.on_commit)


# Called directly (a user's own flow, a deployment), the flow run is named from the template;
# the train flow creates its step flow runs already named (flows/step_flow_runs.py), so the
# flow it runs them with has no template to rename them from.
rollout_step = flow(name="rollout_step", flow_run_name="{config.storage.run_name}/rollout-{rollout_id}",
                    persist_result=False)(_rollout_step)
prenamed_rollout_step = flow(name="rollout_step", persist_result=False)(_rollout_step)


def steps_are_flow_runs(config: RollflowConfig) -> bool:
    """`logging.step_flow_runs` (on unless set false): each step a flow run of its own."""
    return config.logging.step_flow_runs


def open_layout(cfg: RollflowConfig) -> RunLayout:
    s = cfg.storage
    return RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.store_options())


def plots_curves(cfg: RollflowConfig, rollout_id: int) -> bool:
    """Every `logging.plot_interval` steps and at the last: a plot every step would
    cost more than the step's bookkeeping (bench/RESULTS.md, "Orchestration")."""
    interval = cfg.logging.plot_interval
    if not cfg.logging.plot or interval is None:
        return False
    return (rollout_id + 1) % interval == 0 or rollout_id + 1 == cfg.rollout.num_rollout


def _gate(gate: Any, *args: Any, after: Any) -> State[Any]:
    """Run a gate task after `after`; its State is what the next task waits for (a gate
    returns seconds waited, and equal floats would be ambiguous upstream links)."""
    state: State[Any] = gate(*args, wait_for=[after], return_state=True)
    state.result()  # a gate that failed (upstream step failed, timeout) raises here
    return state
