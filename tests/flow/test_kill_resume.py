"""Kill the driver after a step commits (kill -9, or SIGTERM as a scheduler sends it), run it
again: it resumes at the next step, redoes no committed step, and trains exactly the samples
an uninterrupted run trains. SIGTERM ends the driver in one line (exit 143), not in an abort of
Ray's core worker (exit 134, a C++ stack dump)."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from engines.cluster.registry import get_run_actor
from flows.config.loader import dump_config
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.compare import compare_runs
from tests.support.faults import reference_run
from tests.support.procs import start_driver, wait_until_committed

SETTINGS = ("rollout.num_rollout=5", "cluster.keep_actors=true")


def trained_indices(layout: RunLayout) -> list[int]:
    return [s.index for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def flow_run_states(name: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[name])))
    return [run.state.type.value for run in runs]


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_killed_driver_resumes_after_last_committed_step(
    prefect_api, make_config, tmp_path, fault_matrix, stop
):
    reference = reference_run(make_config, *SETTINGS)
    expected = trained_indices(RunLayout.open(reference.storage.uri, reference.storage.run_name))

    cfg = make_config("kill", *SETTINGS)
    path = tmp_path / "kill.yaml"
    path.write_text(dump_config(cfg))
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)

    driver = start_driver(str(path), prefect_api)
    wait_until_committed(driver, layout, 1, timeout_s=180)
    driver.send_signal(stop)
    stopped_out, _ = driver.communicate(timeout=120)
    assert driver.returncode == (143 if stop == signal.SIGTERM else -signal.SIGKILL), stopped_out
    if stop == signal.SIGTERM:
        assert "terminated (" in stopped_out and "SIGTERM received" not in stopped_out
    committed_before = layout.committed_steps()
    assert committed_before[:2] == [0, 1] and len(committed_before) < 5
    step1 = os.path.join(layout.uri, "steps/000001/rollout.arrow")
    mtime = os.stat(step1).st_mtime_ns

    rerun = start_driver(str(path), prefect_api)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out
    assert f'"resumed_at": {len(committed_before)}' in out
    assert layout.committed_steps() == [0, 1, 2, 3, 4]
    assert os.stat(step1).st_mtime_ns == mtime
    assert trained_indices(layout) == expected
    trainer = get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "trainer")
    assert ray.get(trainer.trained_indices.remote()) == expected
    # the killed driver's flow run ended Crashed: by its own hook on SIGTERM, by the rerun
    # after kill -9 (Prefect would show it Running for ever)
    assert sorted(flow_run_states(f"train-{cfg.storage.run_name}")) == ["COMPLETED", "CRASHED"]
    same = compare_runs(reference, cfg)
    assert same.identical, same
    fault_matrix.add(f"{'kill -9' if stop == signal.SIGKILL else 'SIGTERM'} of the driver "
                     "after step 1", "rerun of the same command",
                     "resumes at the first uncommitted step, committed files untouched",
                     same.identical)
