"""How the train flow runs each rollout step: its tasks in the train flow run by default, a
child flow run without a heartbeat thread with `logging.step_flow_runs`; curves on schedule."""

from __future__ import annotations

from prefect.settings import get_current_settings

import flows.rollout_step as rs
from flows.config_loader import config_from_dict
from tasks.step_context import StepContext


def cfg(**logging):
    return config_from_dict({
        "data": {"prompt_data": "x.jsonl"}, "rollout": {"num_rollout": 25, "rollout_batch_size": 1,
                                                     "n_samples_per_prompt": 2},
        "train": {"backend": "mock"}, "engine": {"backend": "mock"}, "logging": logging,
    })


def record_step_paths(monkeypatch) -> list[tuple[str, int, object]]:
    """Which way each step ran: ("flow", id, heartbeat setting) or ("tasks", id, None)."""
    seen: list[tuple[str, int, object]] = []
    monkeypatch.setattr(rs, "rollout_step", lambda config, rollout_id: seen.append(
        ("flow", rollout_id, get_current_settings().flows.heartbeat_frequency)) or {})
    monkeypatch.setattr(rs, "run_step_tasks", lambda ctx, rollout_id: seen.append(
        ("tasks", rollout_id, None)) or {})
    return seen


def test_steps_run_as_tasks_of_the_train_flow_run_by_default(monkeypatch):
    seen = record_step_paths(monkeypatch)
    rs.run_rollout_step(StepContext(cfg(), None, None), 0)
    assert seen == [("tasks", 0, None)]


def test_step_flow_runs_without_a_heartbeat_thread(monkeypatch):
    seen = record_step_paths(monkeypatch)
    before = get_current_settings().flows.heartbeat_frequency
    ctx = StepContext(cfg(step_flow_runs=True), None, None)
    rs.run_rollout_step(ctx, 0)
    rs.run_rollout_step(ctx, 1)
    assert before is not None and seen == [("flow", 0, None), ("flow", 1, None)]
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


def test_long_runs_make_each_step_a_flow_run_unless_told():
    """Past ~1,000 steps the train run's graph would pass the Prefect server's 10,000 nodes
    (the UI stops drawing it): unset, `step_flow_runs` follows the run's length."""
    def long(steps, **logging):
        c = cfg(**logging)
        c.rollout.num_rollout = steps
        return c

    assert not rs.steps_are_flow_runs(long(rs.MAX_STEPS_IN_ONE_GRAPH))
    assert rs.steps_are_flow_runs(long(rs.MAX_STEPS_IN_ONE_GRAPH + 1))
    assert not rs.steps_are_flow_runs(long(5000, step_flow_runs=False))
    assert rs.steps_are_flow_runs(long(2, step_flow_runs=True))
