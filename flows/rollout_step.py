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

from typing import Any, cast

from prefect import State, flow
from prefect.utilities.annotations import quote

from engines.cluster.actors import attached_actors
from engines.cluster.head import connect
from engines.weights.schedule import evaluates_after
from flows.config import RollflowConfig
from flows.prefect_workarounds import (
    child_flow_heartbeats_off,
    results_linked_within_step,
    untagged_tasks,
)
from flows.reporting import publish_step_report
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


def run_step_tasks(ctx: StepContext, rollout_id: int) -> dict[str, Any]:
    """Run (or finish) step `rollout_id`; a committed step returns its metrics untouched.
    A failure is marked in storage (the failure notice names the step and task) and raised."""
    layout = ctx.layout
    if layout.is_committed(rollout_id):
        return layout.step_metrics(rollout_id)
    layout.clear_failure(rollout_id)
    try:
        # the flow run keeps its tags (flows/run_labels.py); links stay within the step
        with untagged_tasks(), results_linked_within_step():
            metrics = run_stages(ctx, rollout_id)
    except BaseException as e:
        layout.mark_failed(rollout_id, repr(e))
        raise
    publish_step_report(layout, rollout_id, metrics, make_plot=plots_curves(config_of(ctx), rollout_id))
    return metrics


def run_rollout_step(ctx: StepContext, rollout_id: int) -> dict[str, Any]:
    """Step `rollout_id` as the train flow runs it: its tasks in the current flow run, or
    in a child `rollout_step` flow run (without a heartbeat thread of its own) for
    `steps_are_flow_runs`."""
    config = config_of(ctx)
    if steps_are_flow_runs(config):
        with child_flow_heartbeats_off():
            return rollout_step(config, rollout_id)
    return run_step_tasks(ctx, rollout_id)


def config_of(ctx: StepContext) -> RollflowConfig:
    """The whole config of a context the flows made (tasks see it as engines' `RunConfig`)."""
    return cast(RollflowConfig, ctx.cfg)


@flow(name="rollout_step", flow_run_name="{config.storage.run_name}/rollout-{rollout_id}",
      persist_result=False)
def rollout_step(config: RollflowConfig, rollout_id: int) -> dict[str, Any]:
    """Run (or finish) step `rollout_id` as a flow run of its own."""
    connect(config.cluster)
    layout = open_layout(config)
    if layout.is_committed(rollout_id):
        return layout.step_metrics(rollout_id)
    return run_step_tasks(StepContext(config, layout, attached_actors(config)), rollout_id)


# The Prefect server draws a flow run's graph up to 10,000 nodes (its task and child flow
# runs); a step adds 7 tasks to the train run, 10 in async mode, plus any evaluation.
MAX_STEPS_IN_ONE_GRAPH = 900


def steps_are_flow_runs(config: RollflowConfig) -> bool:
    """`logging.step_flow_runs`, or when unset, whether the run has too many steps for the
    UI to draw the train run's graph with their tasks in it."""
    chosen = config.logging.step_flow_runs
    return chosen if chosen is not None else config.rollout.num_rollout > MAX_STEPS_IN_ONE_GRAPH


def open_layout(cfg: RollflowConfig) -> RunLayout:
    s = cfg.storage
    return RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.storage_options)


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
