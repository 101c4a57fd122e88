"""The tests' read of a flow run's task runs waits for the server to record them: right
after a run, a busy server returned a step's commit task Pending under its first name
(`commit-4df`, test_rollout_flow failing with py-spy attached to the harness's server), and
a moment later the same task run Completed as `rollout-1/commit`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import prefect_ui


def _answers(*reads: list[tuple[str, str]]) -> list[list[dict[str, Any]]]:
    return [[{"id": "t1", "name": name, "state_type": state} for name, state in read]
            for read in reads]


def test_names_are_read_once_every_task_run_is_final_and_two_reads_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _answers([("commit-4df", "PENDING")], [("rollout-1/commit", "COMPLETED")],
                     [("rollout-1/commit", "COMPLETED")])
    calls: list[str] = []

    def post(api_url: str, path: str, body: dict[str, Any]) -> Any:
        calls.append(path)
        return reads[min(len(calls), len(reads)) - 1]

    monkeypatch.setattr(prefect_ui, "post", post)
    monkeypatch.setattr(prefect_ui.time, "sleep", lambda s: None)
    assert prefect_ui.task_run_names("http://api", "run") == ["rollout-1/commit"]
    assert len(calls) == 3  # the Pending read, then two that agree


def test_a_server_that_never_settles_returns_what_it_has_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefect_ui, "post",
                        lambda *a: _answers([("commit-4df", "PENDING")])[0])
    monkeypatch.setattr(prefect_ui.time, "sleep", lambda s: None)
    runs = prefect_ui.settled_task_runs("http://api", "run", timeout_s=0.05)
    assert [r["name"] for r in runs] == ["commit-4df"]
