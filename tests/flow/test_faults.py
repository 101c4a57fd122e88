"""Fault injection: each fault is survived, and the samples trained over the run are exactly
those of an uninterrupted run with the same seed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import ray
import torch
from safetensors.torch import load_file

from engines.cluster.registry import get_run_actor
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.flow.configs import arithmetic_config


def make_config(env, name, backend="mock", overrides=()):
    prefect_api, ray_address, data, model, tmp_path = env
    return arithmetic_config(
        run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"), data=data,
        model_dir=model, ray_address=ray_address, backend=backend,
        overrides=["rollout.num_rollout=3", *overrides],
    )


def trained_indices(cfg) -> list[int]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return [s.index for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def run_with_fault(cfg, when: Callable[[RunLayout], bool], fault: Callable[[], None]) -> dict:
    """Run the train flow in a thread; fire `fault` once `when(layout)` holds."""
    from flows.train import train

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(train(cfg)))
    thread.start()
    fired = False
    while thread.is_alive():
        if not fired and when(layout):
            fault()
            fired = True
        time.sleep(0.01)
    thread.join()
    assert fired, "the fault never fired"
    assert result, "the train flow did not return"
    return result


def kill(cfg, role):
    ray.kill(get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, role))


def test_task_raising_once_is_retried(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path, fault_matrix):
    from flows.train import train

    env = (prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path)
    reference = make_config(env, "ref")
    train(reference)
    cfg = make_config(env, "flaky", overrides=[
        "rollout.rm_type=null", "rollout.custom_rm_path=tests.flow.faults:reward_failing_once"])
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.store.exists("fault-fired")
    assert layout.committed_steps() == [0, 1, 2]
    assert trained_indices(cfg) == trained_indices(reference)
    fault_matrix.add("reward raises once (transient)", "in generate", "task retried by "
                     "Prefect, run completes", True)


def test_engine_killed_mid_generate(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path, fault_matrix):
    from flows.train import train

    env = (prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path)
    slow = ["rollout.rollout_batch_size=32", "rollout.max_response_len=48"]
    reference = make_config(env, "ref", backend="embedded", overrides=slow)
    train(reference)
    cfg = make_config(env, "engine-kill", backend="embedded", overrides=slow)
    run_with_fault(cfg, lambda lay: lay.task_record(1, "sample_prompts") is not None,
                   lambda: kill(cfg, "engine-0"))
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1, 2]
    for k in range(3):
        groups: dict[int, int] = {}
        for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow"):
            groups[s.group_index] = groups.get(s.group_index, 0) + 1
        assert len(groups) == 32 and set(groups.values()) == {cfg.rollout.n_samples_per_prompt}
    assert trained_indices(cfg) == trained_indices(reference)
    fault_matrix.add("engine actor killed mid-generate", "generate task fails", "retry "
                     "recreates the engine, step regenerated, run completes", True)


def final_weights(cfg) -> dict[str, torch.Tensor]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return load_file(f"{layout.uri}/checkpoints/{cfg.rollout.num_rollout - 1:06d}/model.safetensors")


def test_trainer_killed_mid_train_is_rebuilt(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path, fault_matrix):
    from flows.train import train

    env = (prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path)
    bigger = ["rollout.rollout_batch_size=64", "train.global_batch_size=16"]
    reference = make_config(env, "ref", backend="embedded", overrides=bigger)
    train(reference)
    cfg = make_config(env, "trainer-kill", backend="embedded", overrides=bigger)
    result = run_with_fault(cfg, lambda lay: lay.task_record(1, "reward") is not None,
                            lambda: kill(cfg, "trainer"))
    assert RunLayout.open(cfg.storage.uri, cfg.storage.run_name).committed_steps() == [0, 1, 2]
    assert trained_indices(cfg) == trained_indices(reference)
    expected, got = final_weights(reference), final_weights(cfg)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert result["run_dir"]
    fault_matrix.add("trainer actor killed mid-train", "train task fails", "trainer rebuilt "
                     "from checkpoint + replay, final weights equal (1e-5)", True)
