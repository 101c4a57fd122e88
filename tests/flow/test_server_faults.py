"""The servers a run depends on, killed mid-step under a driver run as a user runs it
(`rollflow train --config ...` in a subprocess): the Prefect server it reports to (killed
with -9 and started again on the same port and database), the driver's own local Prefect
server, and the Ray head (stopped by another shell's `rollflow cluster down --force`, every
actor with it). Each time the run either goes on by itself
or the same command resumes it, and every step trains exactly the samples of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from engines.process import free_port
from flows.bookkeeping.head_watch import HEAD_GONE_EXIT
from flows.config.loader import dump_config
from flows.servers.prefect_server import start_server
from storage.run_layout import RunLayout
from tests.support import REPO_ROOT
from tests.support.faults import reference_run
from tests.support.hooks import RELEASE_FILE
from tests.support.procs import rollflow_env
from tests.support.server_faults import (
    head_processes_of,
    kill_processes,
    prefect_servers_under,
    train_command,
    trained_samples,
    wait_until,
)

STEPS = ("rollout.num_rollout=4",)  # the fault fires in step 1


def layout_of(cfg) -> RunLayout:
    return RunLayout.open(cfg.storage.uri, cfg.storage.run_name)


def mid_step(layout: RunLayout):
    return lambda: layout.task_record(1, "sample_prompts") is not None


def finish(cfg, path: Path, env: dict[str, str], driver) -> tuple[str, str]:
    """Wait for the driver; rerun the same command if it failed. (outcome, the first
    driver's output)"""
    out, _ = driver.communicate(timeout=600)
    if driver.returncode == 0:
        assert '"resumed_at": 0' in out, out[-3000:]
        return "survived: the driver went on by itself", out
    committed = layout_of(cfg).committed_steps()
    rerun = train_command(str(path), env)
    again, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, again[-3000:]
    assert f'"resumed_at": {len(committed)}' in again, again[-3000:]
    return "driver failed; the same command resumed", out


def write_config(cfg, tmp_path: Path) -> Path:
    path = tmp_path / f"{cfg.storage.run_name}.yaml"
    path.write_text(dump_config(cfg))
    return path


def test_prefect_server_killed_and_restarted_mid_step(make_config, prefect_api, tmp_path,
                                                       fault_matrix):
    reference = reference_run(make_config, *STEPS)
    home = tmp_path / "prefect-home"
    port = free_port()
    server = start_server("127.0.0.1", port, str(home), wait_s=180,
                          log_path=str(tmp_path / "server.log"))
    cfg = make_config("prefect-kill", *STEPS)
    path = write_config(cfg, tmp_path)
    env = {**os.environ, "PREFECT_API_URL": server.api_url}
    driver = train_command(str(path), env)
    try:
        wait_until("step 1 started", mid_step(layout_of(cfg)), driver)
        server.process.kill()
        server.process.wait(timeout=30)
        time.sleep(3)
        # (its port, free a moment ago, can be a client's for a while: waited for)
        server = start_server("127.0.0.1", port, str(home), wait_s=180,
                              log_path=str(tmp_path / "server.log"), port_busy_s=60)
        outcome, _ = finish(cfg, path, env, driver)
        # the restarted server (same database) has the run, told of its end after the kill
        runs = httpx.post(f"{server.api_url}/flow_runs/filter", timeout=30, json={
            "flow_runs": {"name": {"any_": [f"train-{cfg.storage.run_name}"]}}}).json()
        assert [r["state_type"] for r in runs] == ["COMPLETED"], runs
    finally:
        driver.kill()
        server.stop()
    assert layout_of(cfg).committed_steps() == [0, 1, 2, 3]
    same = trained_samples(layout_of(cfg)) == trained_samples(layout_of(reference))
    fault_matrix.add("Prefect server (`rollflow server`) killed -9 mid-step, restarted 3 s "
                     "later", "the driver's API calls", outcome, same)
    assert same


def test_drivers_local_prefect_server_killed_mid_step(make_config, prefect_api, tmp_path,
                                                       fault_matrix):
    reference = reference_run(make_config, *STEPS)
    cfg = make_config("local-prefect-kill", *STEPS)
    path = write_config(cfg, tmp_path)
    # a user's shell: no PREFECT_API_URL, so the driver starts a Prefect server of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    driver = train_command(str(path), env)
    try:
        wait_until("step 1 started", mid_step(layout_of(cfg)), driver)
        killed = kill_processes(prefect_servers_under(driver.pid))
        assert killed, "the driver has no Prefect server of its own"
        outcome, out = finish(cfg, path, env, driver)
    finally:
        driver.kill()
    assert layout_of(cfg).committed_steps() == [0, 1, 2, 3]
    same = trained_samples(layout_of(cfg)) == trained_samples(layout_of(reference))
    if outcome.startswith("survived"):  # (flows/servers/prefect_server.py, KeepAlive)
        assert "Prefect server (pid" in out and "starting it again on port" in out, out[-3000:]
        outcome += ", its server started again on the same port"
    fault_matrix.add("the driver's own Prefect server killed -9 mid-step",
                     "the driver's API calls", outcome, same)
    assert same


@pytest.mark.timeout(900)
def test_ray_head_stopped_under_a_training(make_config, prefect_api, tmp_path, fault_matrix):
    """`rollflow cluster down` from another shell while the run trains, on a local head of the
    test's own (ROLLFLOW_HOME in /tmp: Ray's socket paths are short) started on demand by the
    driver as for a user: refused, naming the run; with `--force` the head goes (every actor
    with it), the driver ends with one line that says so and names the command that resumes
    the run (before Ray's own 60 s), and that command resumes it."""
    reference = reference_run(make_config, *STEPS)
    # step 1's rewards wait for the release file: the head goes down mid-step however fast
    # the mock backends and however slow the machine (a free run once finished all 4 steps
    # before `cluster down` came)
    cfg = make_config("head-down", *STEPS, "cluster.num_cpus=4", "rollout.rm_type=null",
                      "rollout.custom_rm_path=tests.support.hooks:reward_held_in_step_1")
    cfg.cluster.address = None  # the local head, started on demand
    path = write_config(cfg, tmp_path)
    home = Path(tempfile.mkdtemp(prefix="rf-head-", dir="/tmp"))
    env = rollflow_env(home, PREFECT_API_URL=prefect_api)
    driver = train_command(str(path), env)
    try:
        wait_until("step 1 started", mid_step(layout_of(cfg)), driver, timeout_s=480)
        first_head = json.loads((home / "cluster.json").read_text())["address"]
        refused = cluster_down(env)
        assert refused.returncode == 1 and cfg.storage.run_name in refused.stderr, refused
        assert driver.poll() is None, "a refused `cluster down` stopped the run"
        assert cluster_down(env, "--force").returncode == 0
        stopped_at = time.monotonic()
        out, _ = driver.communicate(timeout=120)
        last = out.strip().splitlines()[-1]
        assert driver.returncode == HEAD_GONE_EXIT, out[-3000:]
        assert time.monotonic() - stopped_at < 60  # rollflow's line, not Ray's timeout
        assert last.startswith(f"rollflow: the Ray head at {first_head} is gone"), out[-3000:]
        command = shlex.split(last.split("Resume it with: ", 1)[1])
        assert command[:3] == ["python", "-m", "flows.cli"], command
        committed = layout_of(cfg).committed_steps()
        assert committed == [0], committed  # held in step 1
        (Path(cfg.storage.uri) / cfg.storage.run_name / RELEASE_FILE).touch()
        rerun = subprocess.run([sys.executable, *command[1:]], cwd=REPO_ROOT, text=True,
                               env={**env, "PYTHONPATH": str(REPO_ROOT)}, timeout=600,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert rerun.returncode == 0, rerun.stdout[-3000:]
        assert f'"resumed_at": {len(committed)}' in rerun.stdout, rerun.stdout[-3000:]
        second_head = json.loads((home / "cluster.json").read_text())["address"]
    finally:
        driver.kill()
        cluster_down(env, "--force")
    assert second_head != first_head  # the rerun started a new head
    assert layout_of(cfg).committed_steps() == [0, 1, 2, 3]
    same = trained_samples(layout_of(cfg)) == trained_samples(layout_of(reference))
    fault_matrix.add("Ray head stopped mid-step (`cluster down --force`, every actor gone)",
                     "the driver loses the cluster", "driver ended with the head-gone line; "
                     "its resume command resumed on a new head with new actors", same)
    assert same
    assert kill_processes(head_processes_of(home)) == []


def cluster_down(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", "cluster", "down", *flags],
                          env=env, capture_output=True, text=True, timeout=120)
