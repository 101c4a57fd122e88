"""How the train flow runs each rollout_step flow run: no heartbeat thread, curves on schedule."""

from __future__ import annotations

from prefect.settings import get_current_settings

import flows.rollout_step as rs
from flows.config_loader import config_from_dict


def cfg(**logging):
    return config_from_dict({
        "data": {"prompt_data": "x.jsonl"}, "rollout": {"num_rollout": 25, "rollout_batch_size": 1,
                                                     "n_samples_per_prompt": 2},
        "train": {"backend": "mock"}, "engine": {"backend": "mock"}, "logging": logging,
    })


def test_step_flow_runs_without_a_heartbeat_thread(monkeypatch):
    seen = []
    monkeypatch.setattr(rs, "rollout_step", lambda config, rollout_id: seen.append(
        get_current_settings().flows.heartbeat_frequency) or {})
    before = get_current_settings().flows.heartbeat_frequency
    rs.run_rollout_step(cfg(), 0)
    rs.run_rollout_step(cfg(), 1)
    assert before is not None and seen == [None, None]
    assert get_current_settings().flows.heartbeat_frequency == before  # restored afterwards


def test_curves_every_plot_interval_and_at_the_last_step():
    assert [k for k in range(25) if rs.plots_curves(cfg(), k)] == [9, 19, 24]
    assert [k for k in range(25) if rs.plots_curves(cfg(plot_interval=None), k)] == []
    assert [k for k in range(25) if rs.plots_curves(cfg(plot=False), k)] == []


def test_deterministic_failures_are_not_retried():
    from prefect.states import Failed

    from engines.prompt_dataset import DatasetError
    from tasks.step_tasks import retry_transient

    bad_row = Failed(data=DatasetError("data.jsonl", 3, "prompt", "empty prompt"))
    flaky = Failed(data=ConnectionError("engine briefly unreachable"))
    assert retry_transient(None, None, bad_row) is False
    assert retry_transient(None, None, flaky) is True
