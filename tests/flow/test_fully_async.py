"""`rollout.mode: async`: generation never stops between steps, each step trains the first
groups that finish, no trained token is staler than `rollout.max_staleness`, and a driver or
rollout actor killed at a random moment loses no group and trains none twice, and a lost
engine is replaced while the loop goes on with every group it had."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import ray

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor
from flows.config.loader import dump_config
from storage.batch_io import read_samples
from storage.run_layout import RunLayout, step_dir
from storage.sample import Sample
from tests.support.configs import config_maker
from tests.support.faults import run_with_fault
from tests.support.procs import start_driver

GROUPS, N = 8, 4


@pytest.fixture(scope="module")
def make_config(ray_address, arithmetic_data, tiny_model_dir, tmp_path_factory):
    return config_maker(
        tmp_path_factory.mktemp("fully-async") / "runs", arithmetic_data, tiny_model_dir,
        ray_address, "rollout.mode=async", f"rollout.rollout_batch_size={GROUPS}",
        f"rollout.n_samples_per_prompt={N}", "rollout.max_response_len=12",
        "train.global_batch_size=8",
    )


def trained_steps(layout: RunLayout) -> dict[int, list[Sample]]:
    return {k: read_samples(layout.store, step_dir(k), "train.arrow")
            for k in layout.committed_steps()}


def assert_exactly_once(layout: RunLayout, steps: int, max_staleness: int) -> None:
    """From the stored files: each step trained GROUPS whole groups, no group twice, none
    with a token staler than the bound; every group drawn was trained or waits in the last
    step's saved buffer (none lost)."""
    trained = trained_steps(layout)
    assert sorted(trained) == list(range(steps))
    pairs = [(s.group_index, s.index) for samples in trained.values() for s in samples]
    assert len(pairs) == len(set(pairs)) == steps * GROUPS * N
    for k, samples in trained.items():
        for s in samples:
            assert len(s.token_versions) == s.response_length > 0
            assert min(s.response_versions()) >= k - max_staleness, (k, s.token_versions)
    last = layout.store.read_json(*layout.datasource_parts(steps - 1, ".json"))
    waiting = read_samples(layout.store, "datasource", last["buffer_file"])
    groups = {g for g, _ in pairs} | {s.group_index for s in waiting}
    assert sorted(groups) == list(range(last["group_index"]))  # drawn: trained or waiting
    assert not {g for g, _ in pairs} & {s.group_index for s in waiting}


def test_async_trains_groups_as_they_finish_within_the_staleness_bound(prefect_api, make_config):
    from flows.train import train

    cfg = make_config("async", "rollout.num_rollout=4", "rollout.max_staleness=1")
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert_exactly_once(layout, 4, max_staleness=1)
    for k in range(1, 4):
        metrics = layout.step_metrics(k)
        # generation went on while step k-1 trained: step k trains tokens of version k-1
        assert metrics["rollout/staleness_max"] == 1, metrics
        assert metrics["rollout/groups"] == GROUPS
    # a step's prompts are drawn by the loop, not by sample_prompts
    assert layout.task_record(0, "sample_prompts")["groups"] == 0


@pytest.mark.timeout(420)  # three CLI drivers of an 8-step run
def test_killed_driver_and_rollout_actor_lose_no_group_and_train_none_twice(
    prefect_api, make_config, tmp_path
):
    """kill -9 of the driver at a random moment; then of the driver and the rollout actor
    (its loop starts again from the last commit's snapshot); then the same command."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    cfg = make_config("async-kill", "rollout.num_rollout=8", "rollout.max_staleness=2",
                      "train.num_epochs_per_rollout=4")
    path = tmp_path / "async-kill.yaml"
    path.write_text(dump_config(cfg))
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)

    for kill_actor in (False, True):
        committed = len(layout.committed_steps())
        driver = start_driver(str(path), prefect_api)
        deadline = time.time() + 180
        while len(layout.committed_steps()) <= committed:  # running, actors up
            assert driver.poll() is None, driver.stdout.read() if driver.stdout else ""
            assert time.time() < deadline, f"no step committed (seed {seed})"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))  # (a step takes 1-2 s here)
        driver.send_signal(signal.SIGKILL)
        driver.communicate(timeout=60)
        if kill_actor:
            ray.kill(get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "rollout"))
    assert len(layout.committed_steps()) < 8, f"the run ended before the kills (seed {seed})"

    rerun = start_driver(str(path), prefect_api)
    out, _ = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, out
    assert_exactly_once(layout, 8, max_staleness=2)


def test_a_lost_engine_is_replaced_and_the_loop_goes_on_with_every_group(
    prefect_api, make_config
):
    """kill -9 of one of two engines once step 0 committed, while the loop generates: its
    requests go to the other engine, the engine is replaced (by the step that found it lost,
    or by the next generate task's check of the pool), and the loop goes on over the new
    engines with every group it had."""
    cfg = make_config("async-engine", "rollout.num_rollout=3", "engine.num_engines=2",
                      "rollout.use_router=false", "rollout.max_response_len=64",
                      "rollout.ignore_eos=true", "rollout.engine_health_interval_s=0.5",
                      "cluster.keep_actors=true")  # the engines are looked at after the run
    victim: dict[str, int] = {}

    def engine_pid(i: int) -> int:
        return int(ray.get(get_run_actor(cfg.cluster.namespace, cfg.storage.run_name,
                                         f"engine-{i}").pid.remote()))

    def ready(layout: RunLayout) -> bool:
        if not victim and layout.task_record(0, "sample_prompts") is not None:
            victim["pid"] = engine_pid(0)
        return bool(victim) and layout.is_committed(0)

    try:
        run_with_fault(cfg, ready, lambda: os.kill(victim["pid"], signal.SIGKILL))
        layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
        assert_exactly_once(layout, 3, max_staleness=1)
        pids = [engine_pid(i) for i in (0, 1)]
        assert victim["pid"] not in pids and len(set(pids)) == 2
    finally:
        kill_run_actors(cfg)
