"""Fault injection: each fault is survived, and the samples trained over the run are exactly
those of an uninterrupted run with the same seed."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.faults import THREE_STEPS, kill, run_with_fault, trained_indices


def test_task_raising_once_is_retried(prefect_api, make_config, fault_matrix):
    from flows.train import train

    reference = make_config("ref", *THREE_STEPS)
    train(reference)
    cfg = make_config("flaky", *THREE_STEPS, "rollout.rm_type=null",
                      "rollout.custom_rm_path=tests.support.hooks:reward_failing_once")
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.store.exists("fault-fired")
    assert layout.committed_steps() == [0, 1, 2]
    assert trained_indices(cfg) == trained_indices(reference)
    fault_matrix.add("reward raises once (transient)", "in generate", "task retried by "
                     "Prefect, run completes", True)


def test_engine_killed_mid_generate(prefect_api, make_config, fault_matrix):
    from flows.train import train

    slow = ["rollout.rollout_batch_size=32", "rollout.max_response_len=48"]
    reference = make_config("ref", *THREE_STEPS, *slow, backend="embedded")
    train(reference)
    cfg = make_config("engine-kill", *THREE_STEPS, *slow, backend="embedded")
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


def test_trainer_killed_mid_train_is_rebuilt(prefect_api, make_config, fault_matrix):
    from flows.train import train

    bigger = ["rollout.rollout_batch_size=64", "train.global_batch_size=16"]
    reference = make_config("ref", *THREE_STEPS, *bigger, backend="embedded")
    train(reference)
    cfg = make_config("trainer-kill", *THREE_STEPS, *bigger, backend="embedded")
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
