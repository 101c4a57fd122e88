"""Which driver may drive a run: the pid logic of `take_over` (the Prefect side, ending a
killed driver's flow runs: tests/flow/test_driver_record.py). The live process another
driver stands for is this test's parent, which outlives it; `crash_flow_runs` is recorded,
not sent to a Prefect server."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from typing import Any

import psutil
import pytest

import flows.bookkeeping.driver_record as driver_record
from flows.bookkeeping.driver_record import DRIVER_FILE, DriverRecord, RunInUseError, take_over
from storage.run_layout import RunLayout


@pytest.fixture
def crashed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []

    def record(flow_run_id: str, pid: int) -> list[str]:
        calls.append((flow_run_id, pid))
        return [flow_run_id]

    monkeypatch.setattr(driver_record, "crash_flow_runs", record)
    return calls


def write_record(layout: RunLayout, record: DriverRecord) -> None:
    layout.store.write_text(json.dumps(asdict(record)), DRIVER_FILE)


def stored(layout: RunLayout) -> dict[str, Any]:
    return dict(json.loads(layout.store.read_text(DRIVER_FILE)))


def test_a_run_driven_by_a_live_driver_on_this_machine_is_refused(tmp_path, crashed):
    layout = RunLayout.open(str(tmp_path), "run")
    other = os.getppid()
    live = replace(DriverRecord.of_this_process("other-run", "runs/run"), pid=other,
                   process_started=psutil.Process(other).create_time())
    write_record(layout, live)
    with pytest.raises(RunInUseError, match=rf"runs/run is being trained .*pid {other}"):
        take_over(layout, "runs/run", flow_run_id="new-run")
    assert stored(layout)["pid"] == other  # kept
    # a copy of that run's directory (with its record) is another run
    assert take_over(layout, "copy/of/run", flow_run_id="new-run") == []
    # a reused pid (another process start time) is not that driver: its runs are ended
    write_record(layout, replace(live, process_started=live.process_started - 100))
    assert take_over(layout, "runs/run", flow_run_id="new-run") == ["other-run"]
    assert crashed == [("other-run", other)]
    assert stored(layout)["flow_run_id"] == "new-run" and stored(layout)["pid"] == os.getpid()


def test_a_driver_on_another_machine_cannot_be_checked_and_is_left_alone(tmp_path, crashed):
    layout = RunLayout.open(str(tmp_path), "run")
    elsewhere = replace(DriverRecord.of_this_process("x", "runs/run"), host="another-host", pid=1)
    write_record(layout, elsewhere)
    assert elsewhere.running() is None
    assert take_over(layout, "runs/run", flow_run_id="new-run") == []
    assert crashed == []


def test_a_rerun_by_the_same_flow_run_or_process_takes_over_quietly(tmp_path, crashed):
    layout = RunLayout.open(str(tmp_path), "run")
    gone = replace(DriverRecord.of_this_process("run-1", "runs/run"), pid=os.getppid())
    write_record(layout, gone)
    assert take_over(layout, "runs/run", flow_run_id="run-1") == []  # a retry of that flow run
    write_record(layout, DriverRecord.of_this_process("run-1", "runs/run"))
    assert take_over(layout, "runs/run", flow_run_id="run-2") == []  # this very process
    assert crashed == []


def test_a_driver_that_ended_is_not_running_though_its_process_lives(tmp_path: Any) -> None:
    """`rollflow runs list` reads a run trained in a notebook (or a test) as not running once
    train() returned."""
    layout = RunLayout.open(str(tmp_path), "run")
    take_over(layout, layout.uri, "flow-run-1")
    assert driver_record.read_record(layout).running()  # type: ignore[union-attr]
    driver_record.mark_ended(layout)
    ended = driver_record.read_record(layout)
    assert ended is not None and ended.ended_at is not None and ended.running() is False
