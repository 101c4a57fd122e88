"""How the train flow runs each rollout step: a flow run of its own by default (created
ahead, run without a heartbeat thread: tests/flow/test_prefect_ui.py runs them), its tasks in
the train flow run with `logging.step_flow_runs: false`; curves on schedule."""

from __future__ import annotations

from prefect.settings import get_current_settings

import flows.rollout_step as rs
from flows.config.loader import config_from_dict
from flows.step_flow_runs import StepsInThisFlowRun, step_flow_runs
from tasks.step_context import StepContext


def cfg(**logging):
    return config_from_dict({
        "data": {"prompt_data": "x.jsonl"}, "rollout": {"num_rollout": 25, "rollout_batch_size": 1,
                                                     "n_samples_per_prompt": 2},
        "train": {"backend": "mock"}, "engine": {"backend": "mock"}, "logging": logging,
    })


def test_folded_steps_run_their_tasks_in_the_current_flow_run(monkeypatch):
    seen: list[tuple[StepContext, int]] = []
    monkeypatch.setattr(rs, "run_step", lambda ctx, rollout_id, on_commit: seen.append(
        (ctx, rollout_id)) or {})
    folded = cfg(step_flow_runs=False)
    ctx = StepContext(folded, None, None)
    with step_flow_runs(rs.rollout_step, folded) as steps:
        assert isinstance(steps, StepsInThisFlowRun)  # no flow run, no Prefect client
        steps.run(ctx, 3)
        steps.run(ctx, 4)
    assert seen == [(ctx, 3), (ctx, 4)]  # the driver's context: no actors looked up


def test_a_step_flow_run_runs_without_a_heartbeat_thread():
    from flows.prefect_workarounds import child_flow_heartbeats_off

    before = get_current_settings().flows.heartbeat_frequency
    with child_flow_heartbeats_off():
        inside = get_current_settings().flows.heartbeat_frequency
    assert before is not None and inside is None
    assert get_current_settings().flows.heartbeat_frequency == before  # restored afterwards


def test_step_task_runs_are_named_after_their_step():
    from tasks import step_gates as gates
    from tasks import step_tasks as t

    names = [t.sample_prompts, gates.wait_for_weights, t.generate, t.filter_groups, t.reward,
             gates.wait_for_previous_commit, t.train_step, gates.wait_for_next_generate,
             t.broadcast_weights, t.commit]
    assert [task.task_run_name.format(rollout_id=3) for task in names] == [
        f"rollout-3/{task.name}" for task in names]


def test_curves_every_plot_interval_and_at_the_last_step():
    assert [k for k in range(25) if rs.plots_curves(cfg(), k)] == [9, 19, 24]
    assert [k for k in range(25) if rs.plots_curves(cfg(plot_interval=None), k)] == []
    assert [k for k in range(25) if rs.plots_curves(cfg(plot=False), k)] == []


def test_deterministic_failures_are_not_retried():
    from prefect.states import Failed

    from engines.data.prompt_dataset import DatasetError
    from tasks.retries import retry_transient

    bad_row = Failed(data=DatasetError("data.jsonl", 3, "prompt", "empty prompt"))
    flaky = Failed(data=ConnectionError("engine briefly unreachable"))
    assert retry_transient(None, None, bad_row) is False
    assert retry_transient(None, None, flaky) is True
