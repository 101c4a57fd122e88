"""The driver and the rollout actor are killed (kill -9, the machine they shared gone) in the
middle of a long generate, most of the step's groups finished: the rerun of the same command
takes the finished groups back from the step's group journal, generates only those that
were in flight, and trains exactly the samples of an uninterrupted run, step by step."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import ray

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor
from flows.config.loader import dump_config
from storage.batch_io import read_samples
from storage.group_journal import GroupJournal
from storage.run_layout import RunLayout, step_dir
from tests.support.configs import arithmetic_config
from tests.support.hooks import GROUPS_PER_STEP
from tests.support.procs import start_driver

GROUPS, N = GROUPS_PER_STEP, 4
KILLED_STEP = 1


def trained(layout: RunLayout) -> list[list]:
    return [read_samples(layout.store, step_dir(k), "train.arrow")
            for k in layout.committed_steps()]


def scored(layout: RunLayout) -> list[int]:
    path = os.path.join(layout.uri, "scored.txt")
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


@pytest.mark.timeout(300)  # three runs of the train flow, two of them CLI drivers (~80 s)
def test_killed_mid_generate_keeps_the_finished_groups(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path, fault_matrix
):
    def config(run_name):
        return arithmetic_config(
            run_name=run_name, runs_root=str(tmp_path / "runs"), data=arithmetic_data,
            model_dir=tiny_model_dir, ray_address=ray_address,
            overrides=["rollout.num_rollout=2", f"rollout.rollout_batch_size={GROUPS}",
                       f"rollout.n_samples_per_prompt={N}", "rollout.rm_type=null",
                       "rollout.custom_rm_path=tests.support.hooks:slow_exact_match"],
        )

    from flows.train import train

    reference = config(f"journal-ref-{uuid.uuid4().hex[:6]}")
    train(reference)
    expected = trained(RunLayout.open(reference.storage.uri, reference.storage.run_name))

    cfg = config(f"journal-kill-{uuid.uuid4().hex[:6]}")
    path = tmp_path / "journal-kill.yaml"
    path.write_text(dump_config(cfg))
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    journal = GroupJournal(layout.store, step_dir(KILLED_STEP))

    def finished_groups() -> list[int]:
        return [item["group_index"] for e in journal.entries() if e.record["kind"] == "groups"
                for item in e.record["groups"]]

    driver = start_driver(str(path), prefect_api)
    try:
        deadline = time.time() + 180
        while len(finished_groups()) < GROUPS * 5 // 8:
            assert driver.poll() is None, driver.stdout.read() if driver.stdout else ""
            assert time.time() < deadline, "step 1's generate never got past half its groups"
            time.sleep(0.05)
        rollout = get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "rollout")
        driver.send_signal(signal.SIGKILL)
        ray.kill(rollout)  # what the driver's machine took with it
        driver.communicate(timeout=60)
        time.sleep(1.0)  # the killed actor's last writes, if any, land before we look
        committed = finished_groups()
        assert GROUPS // 2 <= len(committed) < GROUPS and not layout.is_committed(KILLED_STEP)
        scored_before = len(scored(layout))

        rerun = start_driver(str(path), prefect_api)
        out, _ = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, out
    finally:
        kill_run_actors(cfg)
    assert layout.committed_steps() == [0, 1]
    metrics = layout.step_metrics(KILLED_STEP)
    assert metrics["rollout/groups_restored"] == len(committed)
    regenerated = {i // N for i in scored(layout)[scored_before:] if i // N < GROUPS * 2}
    assert not regenerated & set(committed)  # no finished group generated again
    assert regenerated == set(range(GROUPS, 2 * GROUPS)) - set(committed)
    assert 0 < metrics["rollout/tokens_regenerated"] < metrics["rollout/tokens_restored"]
    assert not layout.store.exists(step_dir(KILLED_STEP), "groups")  # removed once committed
    same = trained(layout) == expected
    assert same
    fault_matrix.add("driver and rollout actor killed (kill -9) mid-generate, "
                     f"{len(committed)} of {GROUPS} groups finished",
                     "rerun of the same command",
                     f"{len(committed)} groups restored from the journal, only the "
                     f"{GROUPS - len(committed)} in flight generated again", same)
