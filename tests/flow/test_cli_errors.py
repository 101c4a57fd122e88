"""`rollflow train` failing inside an actor during step 0, as a user runs it: the cause from
inside Ray is the first line on stderr (not Prefect's or Ray's tracebacks), then the path of
the log in the run directory, which holds the tracebacks. Afterwards `rollflow runs list|show`
show that run, and one that failed in preflight, as failed, with their causes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from engines.cluster.actors import kill_run_actors
from flows.cli import main
from flows.config.loader import dump_config
from tests.support import REPO_ROOT
from tests.support.configs import arithmetic_config

BROKEN_REWARD = '''
async def broken(args, sample):
    raise ValueError("this reward is broken")
'''


def test_error_in_an_actor_prints_its_cause_first(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path, capsys
):
    (tmp_path / "myreward.py").write_text(BROKEN_REWARD)  # found via the working directory
    cfg = arithmetic_config(
        run_name=f"broken-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=["rollout.custom_rm_path=myreward:broken"],
    )
    config = tmp_path / "broken.yaml"
    config.write_text(dump_config(cfg))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO_ROOT),
           "ROLLFLOW_HOME": str(tmp_path / "home")}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", "train", "--config", str(config)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )
    finally:
        kill_run_actors(cfg)  # a run failed mid-step keeps its actors for a resume

    # Ray's own "Connecting to existing Ray cluster" lines come before the run starts.
    lines = [ln for ln in done.stderr.splitlines() if "INFO worker.py" not in ln]
    # A bug in the user's reward is reported as such (hook, sample, original error) at the
    # first attempt: it fails the same way every time, so the step is not retried.
    assert done.returncode == 2, done.stderr
    assert lines[0].startswith(
        "HookError: rollout.custom_rm_path: myreward:broken failed on sample "), done.stderr
    assert lines[0].endswith(
        ": ValueError: this reward is broken (in RolloutManager.generate)"), done.stderr
    assert len(lines) == 2, done.stderr  # Prefect's tracebacks went to the log only
    log = Path(lines[1].split("full traceback: ")[1].split(" ")[0])
    assert log.parent == Path(cfg.storage.uri) / cfg.storage.run_name / "logs"
    text = log.read_text()
    assert "Traceback" in text and "Prefect's log of the failed runs" in text
    assert "not retried" in text and "retrying" not in text

    # A second run fails in preflight, after the storage check made its directory.
    early = cfg.model_copy(deep=True)
    early.storage.run_name += "-early"
    early.rollout.custom_rm_path = "myreward:missing"
    (tmp_path / "early.yaml").write_text(dump_config(early))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", "early.yaml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    preflight_cause = done.stderr.splitlines()[0]
    assert preflight_cause.startswith("HookError: rollout.custom_rm_path"), done.stderr

    root, run = cfg.storage.uri, cfg.storage.run_name
    capsys.readouterr()
    assert main(["runs", "list", "--root", root]) == 0
    listed = {ln.split("\t")[0]: ln.split("\t")[1:] for ln in capsys.readouterr().out.splitlines()}
    assert listed[run][:2] == ["failed", "steps=0/2"], listed
    assert listed[run][2] == f"step 0: {lines[0]}"
    assert listed[f"{run}-early"] == ["failed", "steps=0", preflight_cause]

    assert main(["runs", "show", run, "--root", root]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"run {run}: failed, 0/2 steps committed", f"cause: step 0: {lines[0]}",
        f"to resume: rollflow train --config {Path(root) / run / 'config.yaml'}"]
    assert main(["runs", "show", f"{run}-early", "--root", root]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"run {run}-early: failed, 0 steps committed", f"cause: {preflight_cause}",
        "to resume: rollflow train --config early.yaml"]
