"""What the Prefect UI shows of a training, read back through the API the UI uses (the
browser itself: tests/flow/test_browser_ui.py): the train run tagged after its training,
each step's tasks named after the step and drawn as a chain (in a step flow run of their
own, or in the train run with `logging.step_flow_runs: false`), per-run artifact keys, rounded
tables, the inlined curves, held-out accuracy, a retried task's log line and the failure
notice."""

from __future__ import annotations

import base64
import re
import uuid

import pytest

from tests.support.configs import arithmetic_config
from tests.support.prefect_ui import (
    CHAIN,
    artifacts,
    chain_edges,
    flow_runs,
    graph_edges,
    logs,
    step_edges,
    step_labels,
    task_run_names,
)


@pytest.fixture
def make_cfg(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path):
    def make(name: str, *overrides: str):
        return arithmetic_config(
            run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
            data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
            overrides=["logging.plot=true", *overrides],
        )
    return make


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def flush_logs() -> None:
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()


def significant_digits(x: float) -> int:
    return len(re.sub(r"^0+", "", re.sub(r"e.*$|[-.]", "", repr(x))).rstrip("0"))


def test_steps_are_named_tagged_chained_and_report_per_run(make_cfg, arithmetic_data):
    from flows.train import train

    cfg = make_cfg("ui", "logging.step_flow_runs=false", "logging.plot_interval=1",
                   "eval.before_train=true",
                   f"eval.datasets=[{{name: test, path: {arithmetic_data['test']}, max_prompts: 8}}]")
    run = cfg.storage.run_name
    train(cfg)
    url = api_url()
    runs = flow_runs(url, [f"train-{run}", f"{run}/rollout-0", f"{run}/rollout-1"])
    assert sorted(runs) == [f"train-{run}"]  # the steps are tasks of the train run
    train_run = runs[f"train-{run}"]
    labels = {"rollflow", f"run:{run}", "algo:grpo", "engine:mock", "train:mock"}
    assert labels <= set(train_run["tags"]), train_run["tags"]

    names = task_run_names(url, train_run["id"])
    assert set(step_labels(0) + step_labels(1)) <= set(names), names
    edges = graph_edges(url, train_run["id"])
    assert step_edges(edges, 0) == chain_edges(0) and step_edges(edges, 1) == chain_edges(1)

    train_art = artifacts(url, train_run["id"])
    table = train_art[f"{run}-step-metrics"]["data"]
    assert {row["metric"] for row in table} >= {"reward/mean", "time/generate"}
    curves = train_art[f"{run}-reward-curves"]
    assert curves["type"] == "markdown"
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)",
                                     curves["data"]).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(curves["data"]) < 60_000

    rows = train_art[f"{run}-run-metrics"]["data"]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    floats = [v for r in rows for v in r.values() if isinstance(v, float)]
    assert floats and all(significant_digits(v) <= 4 for v in floats), floats
    history = train_art[f"{run}-eval-history"]["data"]
    assert [r["weight_version"] for r in history] == [0, 2]
    assert all(0.0 <= r["eval/test"] <= 1.0 for r in history)
    evals = train_art[f"{run}-eval"]["data"]  # the newest of the per-evaluation tables
    assert {(r["weight_version"], r["metric"]) for r in evals} >= {(2, "eval/test")}


def test_step_flow_runs_group_each_steps_tasks(make_cfg):
    from flows.train import train

    cfg = make_cfg("ui-steps", "logging.plot_interval=1")  # the default: a flow run per step
    run = cfg.storage.run_name
    train(cfg)
    url = api_url()
    runs = flow_runs(url, [f"train-{run}", f"{run}/rollout-0", f"{run}/rollout-1",
                           f"{run}/rollout-2"])
    assert len(runs) == 3, sorted(runs)  # none created ahead past the last step
    labels = {"rollflow", f"run:{run}", "algo:grpo", "engine:mock", "train:mock"}
    assert all(labels <= set(r["tags"]) for r in runs.values()), [r["tags"] for r in runs.values()]
    step = runs[f"{run}/rollout-1"]
    assert task_run_names(url, step["id"]) == sorted(step_labels(1))
    assert graph_edges(url, step["id"]) == chain_edges(1)
    in_train = task_run_names(url, runs[f"train-{run}"]["id"])  # the steps' stand-ins
    assert in_train == ["rollout_step-0", "rollout_step-1"], in_train
    step_art = artifacts(url, step["id"])
    assert {f"{run}-step-metrics", f"{run}-reward-curves"} <= set(step_art)


def test_async_steps_draw_the_gates_in_the_chain(make_cfg):
    from flows.train import train

    cfg = make_cfg("ui-async", "rollout.mode=one_step", "rollout.num_rollout=3")
    run = cfg.storage.run_name
    train(cfg)
    step_run = flow_runs(api_url(), [f"{run}/rollout-1"])[f"{run}/rollout-1"]
    chain = ("sample_prompts", "wait_for_weights", "generate", "filter", "reward",
             "wait_for_previous_commit", "train", "wait_for_next_generate",
             "broadcast_weights", "commit")
    assert step_edges(graph_edges(api_url(), step_run["id"]), 1) == chain_edges(1, chain)


def test_a_retried_task_says_what_failed(make_cfg):
    from flows.train import train

    cfg = make_cfg("ui-flaky", "rollout.rm_type=null",
                   "rollout.custom_rm_path=tests.support.hooks:reward_failing_once")
    run = cfg.storage.run_name
    train(cfg)
    flush_logs()
    steps = flow_runs(api_url(), [f"{run}/rollout-0", f"{run}/rollout-1"]).values()
    messages = [entry["message"] for step in steps for entry in logs(api_url(), step["id"])]
    assert any("generate attempt 1 failed with ConnectionError: injected transient fault; "
               "retrying (attempt 2 of 3)" in m for m in messages), messages


def test_a_failed_training_leaves_a_failure_notice(make_cfg):
    from flows.train import train

    cfg = make_cfg("ui-broken", "rollout.rm_type=null",
                   "rollout.custom_rm_path=tests.support.hooks:reward_nan_after_step_0")
    run = cfg.storage.run_name
    with pytest.raises(Exception):  # noqa: B017 - the failure itself is tested elsewhere
        train(cfg)
    flush_logs()
    train_run = flow_runs(api_url(), [f"train-{run}"])[f"train-{run}"]
    notice = artifacts(api_url(), train_run["id"])[f"{run}-failure"]["data"]
    assert f"Training `{run}` failed" in notice
    assert "step 1, task `generate` (1 of 2 steps committed)" in notice, notice
    assert "nan" in notice.lower() and "To resume" in notice
    assert any(f"Training `{run}` failed" in e["message"] and e["level"] >= 40
               for e in logs(api_url(), train_run["id"]))


def test_chain_is_the_tasks_of_a_step():
    from tasks import step_tasks as t

    names = [t.sample_prompts, t.generate, t.filter_groups, t.reward, t.train_step,
             t.broadcast_weights, t.commit]
    assert tuple(task.name for task in names) == CHAIN
    # no random suffixes: the step and the task
    assert [task.task_run_name.format(rollout_id=1) for task in names] == list(step_labels(1))
