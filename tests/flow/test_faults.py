"""Fault injection: each fault takes effect (an actor's process replaced, a task run twice, a
trainer rebuilt), is survived, and the samples trained over the run are those of an
uninterrupted run with the same seed (`compare_runs`: tokens, rewards, loss masks)."""

from __future__ import annotations

import os
import signal

import ray

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.compare import compare_runs
from tests.support.faults import (
    THREE_STEPS,
    KillWhileWorking,
    actor_pid,
    run_with_fault,
    task_run_counts,
    trained_indices,
)


def test_task_raising_once_is_retried(prefect_api, make_config, fault_matrix):
    from flows.train import train

    def varied(hook):  # a reward that differs between samples: rewards are compared too
        return ["rollout.rm_type=null", f"rollout.custom_rm_path=tests.support.hooks:{hook}"]

    reference = make_config("ref", *THREE_STEPS, *varied("reward_varied"))
    train(reference)
    cfg = make_config("flaky", *THREE_STEPS, *varied("reward_varied_failing_once"))
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.store.exists("fault-fired")
    runs = task_run_counts(cfg, "generate", lambda c: sorted(c.values()) == [1, 1, 2])
    assert sorted(runs.values()) == [1, 1, 2], runs  # one step's generate ran twice
    rewards = {s.reward for s in read_samples(layout.store, "steps/000000", "train.arrow")}
    assert len(rewards) > 1, rewards
    same = compare_runs(reference, cfg)
    assert same.identical, same
    fault_matrix.add("reward raises once (transient)", "in generate", "task retried by "
                     "Prefect, run completes", same.identical)


def test_engine_killed_mid_generate(prefect_api, make_config, fault_matrix):
    from flows.train import train

    # 16 samples in flight of 128: the step generates in waves, so a kill timed from its
    # first finished groups lands while most are still to come (with all 128 in one batch
    # they ended together, and under load the kill could land after generate)
    slow = ["rollout.rollout_batch_size=32", "rollout.max_response_len=48",
            "rollout.sglang_server_concurrency=16"]
    reference = make_config("ref", *THREE_STEPS, *slow, backend="embedded")
    train(reference)
    cfg = make_config("engine-kill", *THREE_STEPS, *slow, "cluster.keep_actors=true",
                      backend="embedded")
    victim: dict[str, int] = {}

    def ready(layout: RunLayout) -> bool:
        """Step 1 generating: its first groups came back (its progress file), the others
        are in flight. The engine's pid is looked up before: listing the cluster's actors
        took seconds in a loaded CI, and a kill timed from there landed after generate."""
        if not victim and layout.task_record(0, "sample_prompts") is not None:
            victim["pid"] = actor_pid(cfg, "engine-0")
        return bool(victim) and layout.store.exists("steps/000001", "generate.progress.json")

    def fire() -> int:
        os.kill(victim["pid"], signal.SIGKILL)
        return victim["pid"]

    try:
        result = run_with_fault(cfg, ready, fire)
        replaced = actor_pid(cfg, "engine-0")
    finally:
        kill_run_actors(cfg)
    assert replaced != result["fault"], "engine-0 is still the process that was killed"
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    healed = layout.step_metrics(1).get("rollout/engines_lost", 0.0) >= 1
    runs = task_run_counts(cfg, "generate", lambda c: len(c) == 3 and (healed or max(c.values()) > 1),
                           timeout_s=20)
    retried = runs.get("rollout-1/generate", 0) > 1
    assert retried or healed, "step 1 neither retried generate nor reported a lost engine"
    for k in range(3):
        groups: dict[int, int] = {}
        for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow"):
            groups[s.group_index] = groups.get(s.group_index, 0) + 1
        assert len(groups) == 32 and set(groups.values()) == {cfg.rollout.n_samples_per_prompt}
    same = compare_runs(reference, cfg)
    assert same.identical, same
    how = ("generate task retried with a new engine" if retried
           else "engine replaced within the step (no task retry)")
    fault_matrix.add("engine actor killed mid-generate", "generate, mid-step",
                     f"{how}, run completes", same.identical)


def test_trainer_killed_mid_train_is_rebuilt(prefect_api, make_config, fault_matrix):
    from flows.train import train

    # several optimizer passes a step: a train call long enough for a kill to land inside
    bigger = ["rollout.rollout_batch_size=64", "train.global_batch_size=16",
              "train.num_epochs_per_rollout=4"]
    reference = make_config("ref", *THREE_STEPS, *bigger, backend="embedded")
    train(reference)
    cfg = make_config("trainer-kill", *THREE_STEPS, *bigger, "cluster.keep_actors=true",
                      backend="embedded")
    try:
        fault = KillWhileWorking(cfg, "trainer", lambda lay: lay.task_record(0, "train") is not None,
                                 lambda lay: lay.task_record(1, "reward") is not None, cpu_s=0.03)
        result = run_with_fault(cfg, fault.when, fault.fire)
        trainer = get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "trainer")
        pid, trained = actor_pid(cfg, "trainer"), ray.get(trainer.trained_indices.remote())
    finally:
        kill_run_actors(cfg)
    assert pid != result["fault"], "the trainer is still the process that was killed"
    # the new trainer holds step 0's samples only because it replayed step 0 to rebuild
    assert trained == trained_indices(reference)
    # the kill lands inside step 1's train call: the task fails and is retried
    runs = task_run_counts(cfg, "train", lambda c: len(c) == 3 and c["rollout-1/train"] > 1,
                           timeout_s=20)
    assert runs.get("rollout-1/train", 0) > 1, f"step 1's train task was not retried: {runs}"
    same = compare_runs(reference, cfg, weights=("model.safetensors",), rtol=1e-5, atol=1e-6)
    assert same.identical, same
    fault_matrix.add("trainer actor killed mid-train (kill -9)", "step 1, train",
                     "train task retried; trainer "
                     "rebuilt by replay, final weights equal (1e-5)", same.identical)
