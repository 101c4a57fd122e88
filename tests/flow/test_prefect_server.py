"""A real Prefect server on loopback (`flows.servers.prefect_server.start_server`), a two-step
train driver reporting to it through PREFECT_API_URL, and the flow run, task runs and
artifacts read back through its REST API."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.process import free_port
from flows.config.loader import dump_config
from flows.servers.prefect_server import PrefectServer, start_server
from tests.support import REPO_ROOT
from tests.support.configs import arithmetic_config
from tests.support.prefect_ui import settled_task_runs

TASKS = {"sample_prompts", "generate", "filter", "reward", "train", "broadcast_weights", "commit"}


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    home = tmp_path_factory.mktemp("prefect-home")
    server = start_server("127.0.0.1", free_port(), str(home), wait_s=180,
                          log_path=str(home / "server.log"))
    try:
        yield server
    finally:
        server.stop()
    assert server.process.poll() is not None


def api(server: PrefectServer, path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(f"{server.api_url}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def test_two_steps_show_up_in_the_prefect_server(
    prefect_server, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    assert prefect_server.healthy()
    assert httpx.get(prefect_server.url, timeout=10).status_code == 200  # the UI is served
    run = f"ui-{uuid.uuid4().hex[:6]}"
    cfg = arithmetic_config(run_name=run, runs_root=str(tmp_path / "runs"), data=arithmetic_data,
                            model_dir=tiny_model_dir, ray_address=ray_address,
                            overrides=["logging.plot=true"])
    path = tmp_path / "ui.yaml"
    path.write_text(dump_config(cfg))
    env = {**os.environ, "PREFECT_API_URL": prefect_server.api_url, "PYTHONPATH": str(REPO_ROOT)}
    driver = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert driver.returncode == 0, driver.stdout[-2000:] + driver.stderr[-4000:]

    flow_runs = {r["name"]: r for r in api(prefect_server, "/flow_runs/filter", {
        "flow_runs": {"name": {"any_": [f"train-{run}", f"{run}/rollout-0", f"{run}/rollout-1"]}}})}
    assert len(flow_runs) == 3, sorted(flow_runs)  # the train run and a flow run per step
    assert {r["state_type"] for r in flow_runs.values()} == {"COMPLETED"}
    train_run = flow_runs[f"train-{run}"]
    assert train_run["parameters"]["config"]["storage"]["run_name"] == run  # config shown

    for k in (0, 1):
        step = flow_runs[f"{run}/rollout-{k}"]
        assert step["parameters"]["rollout_id"] == k
        task_runs = settled_task_runs(prefect_server.api_url, step["id"], min_count=len(TASKS))
        assert {t["name"] for t in task_runs} == {f"rollout-{k}/{name}" for name in TASKS}
        assert {t["state_type"] for t in task_runs} == {"COMPLETED"}

    artifacts = api(prefect_server, "/artifacts/filter", {
        "artifacts": {"flow_run_id": {"any_": [train_run["id"]]}}})
    kinds = {a["key"]: a for a in artifacts if a["key"]}
    assert kinds[f"{run}-run-metrics"]["type"] == "table"
    table = kinds[f"{run}-run-metrics"]["data"]
    table = table if isinstance(table, list) else __import__("json").loads(table)
    assert [row["rollout_id"] for row in table] == [0, 1]
    assert kinds[f"{run}-reward-curves"]["type"] == "markdown"  # the PNG inlined
    assert "data:image/png;base64," in kinds[f"{run}-reward-curves"]["data"]
    progress = kinds[f"{run}-steps"]
    assert progress["type"] == "progress" and float(progress["data"]) == 100.0

    # Each step's metrics table (a version per step) and generation progress, on its step run.
    step_runs = [flow_runs[f"{run}/rollout-{k}"]["id"] for k in (0, 1)]
    on_steps = api(prefect_server, "/artifacts/filter", {
        "artifacts": {"flow_run_id": {"any_": step_runs}}})
    step_tables = sorted(a["description"] for a in on_steps if a["key"] == f"{run}-step-metrics")
    assert [d.split(" of ")[0] for d in step_tables] == ["step 0", "step 1"], step_tables
    assert {a["type"] for a in on_steps if a["key"] == f"{run}-generation"} == {"progress"}


def test_prefect_yaml_deploys_to_the_server(prefect_server):
    api(prefect_server, "/work_pools/", {"name": "rollflow-process", "type": "process"})
    env = {**os.environ, "PREFECT_API_URL": prefect_server.api_url, "PYTHONPATH": str(REPO_ROOT)}
    prefect = str(Path(sys.executable).with_name("prefect"))
    proc = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    deployments = {d["name"]: d for d in api(prefect_server, "/deployments/filter", {})}
    assert sorted(deployments) == [
        "arithmetic-grpo", "arithmetic-grpo-evaluate", "arithmetic-grpo-replay"]
    assert {d["work_pool_name"] for d in deployments.values()} == {"rollflow-process"}
    replay = deployments["arithmetic-grpo-replay"]
    assert {"rollflow", "replay"} <= set(replay["tags"])
    assert (replay["parameters"]["source_run"], replay["parameters"]["end"]) == ("arithmetic-grpo", 5)
    train = deployments["arithmetic-grpo"]
    assert train["parameters"]["config"]["rollout"]["num_rollout"] == 20
    assert "config" in train["parameter_openapi_schema"]["properties"]  # the UI's run form
    # a schedule cannot pile a second driver onto a training that still runs
    assert train["global_concurrency_limit"]["limit"] == 1
    assert train["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert deployments["arithmetic-grpo-replay"]["global_concurrency_limit"] is None
    # Flow runs start in this repo (recorded at deploy time, not the worker's directory),
    # then make the example's data and model there if missing: "Quick run" works as shipped.
    assert train["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}},
        {"examples.arithmetic.deployment.prepare_example":
         {"directory": "examples/arithmetic/artifacts"}}]
