"""The next driver of a run ends the flow runs of a driver killed outright (they would stay
Running in the UI for ever), and a train refused for a run in use raises no failure alert.
Which driver may drive a run (pid logic): tests/unit/test_driver_record.py; the whole path
through a real kill -9: tests/flow/test_kill_resume.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, replace

import psutil
import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.states import Running

from flows.bookkeeping.driver_record import DRIVER_FILE, DriverRecord, RunInUseError, take_over
from storage.run_layout import RunLayout


@flow
def driven() -> None:
    """Stands for the train flow (only its runs are made, never run)."""


@task
def step() -> None:
    """Stands for the task a step flow run hangs under."""


def write_record(layout: RunLayout, record: DriverRecord) -> None:
    layout.store.write_text(json.dumps(asdict(record)), DRIVER_FILE)


def states(client, *ids) -> list[StateType]:
    return [client.read_flow_run(i).state.type for i in ids]


def test_the_flow_runs_of_a_killed_driver_are_set_crashed(prefect_api, tmp_path):
    layout = RunLayout.open(str(tmp_path), "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(gone.pid).create_time()
    gone.wait()
    with get_client(sync_client=True) as client:
        parent = client.create_flow_run(driven, state=Running())
        under = client.create_task_run(step, parent.id, dynamic_key="0", state=Running())
        child = client.create_flow_run(driven, parent_task_run_id=under.id, state=Running())
        finished = client.create_flow_run(driven, parent_task_run_id=under.id)  # Pending
        client.set_flow_run_state(finished.id, Running(), force=True)
        client.set_flow_run_state(finished.id, Running().model_copy(
            update={"type": StateType.COMPLETED, "name": "Completed"}), force=True)
        dead = DriverRecord("", gone.pid, started, str(parent.id), time.time(), "runs/run")
        write_record(layout, replace(dead, host=DriverRecord.of_this_process(None).host))

        crashed = take_over(layout, "runs/run", flow_run_id="new-run")

        assert sorted(crashed) == sorted([str(parent.id), str(child.id)])
        assert states(client, parent.id, child.id, finished.id) == [
            StateType.CRASHED, StateType.CRASHED, StateType.COMPLETED]
        assert "is gone" in client.read_flow_run(parent.id).state.message
    record = json.loads(layout.store.read_text(DRIVER_FILE))
    assert record["flow_run_id"] == "new-run" and record["pid"] != gone.pid


def test_a_train_refused_for_a_run_in_use_ends_cancelled_without_an_alert(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    """The refused driver's flow run (a schedule firing while the last training runs) ends
    Cancelled saying which driver has the run; the run is fine: no failure artifact, no
    `rollflow.training.failed` event for alerts."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterName,
    )

    from flows.train import train
    from tasks.artifacts import artifact_key
    from tests.support.configs import arithmetic_config

    cfg = arithmetic_config(run_name=f"busy-{uuid.uuid4().hex[:6]}",
                            runs_root=str(tmp_path / "runs"), data=arithmetic_data,
                            model_dir=tiny_model_dir, ray_address=ray_address)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = replace(DriverRecord.of_this_process("other-run", layout.uri), pid=other.pid,
                       process_started=psutil.Process(other.pid).create_time())
        write_record(layout, live)
        with pytest.raises(RunInUseError):
            train(cfg)
    finally:
        other.kill()
        other.wait()
    key = artifact_key(cfg.storage.run_name, "failure")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key])))
        (refused,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[f"train-{cfg.storage.run_name}"])))
    assert found == []
    assert refused.state.is_cancelled(), refused.state
    assert "is being trained by another driver" in refused.state.message
