"""debug_train_only replays another run's train batches without engines; debug_rollout_only
uses a trainer that never changes the weights."""

from __future__ import annotations

import pytest

from engines.rollout.rollout_manager import RolloutManager
from engines.train.null_trainer import NullTrainActor
from storage.batch_io import read_samples, write_samples
from storage.run_layout import RunLayout, step_dir
from storage.sample import Sample, Status


def test_debug_train_only_trains_on_the_saved_batch(tmp_path, make_config):
    source = RunLayout.open(str(tmp_path / "other"), "src")
    saved = [Sample(index=i, group_index=i // 2, prompt="1+1=", tokens=[4, 5, 6], response="2",
                    response_length=1, reward=float(i % 2), loss_mask=[1],
                    rollout_log_probs=[-0.1], status=Status.COMPLETED) for i in range(8)]
    write_samples(source.store, saved, step_dir(0), "train.arrow")
    cfg = make_config("dbg", "rollout.debug_train_only=true",
                      f"rollout.debug_rollout_data={source.uri}")
    mgr = RolloutManager(cfg)
    assert mgr.sample_prompts(0).debug_train_only
    assert mgr.generate(0).groups == 4
    kept = mgr.filter(0).kept_groups
    assert kept == (0, 1, 2, 3)
    assert mgr.reward(0, kept).samples == 8
    trained = read_samples(mgr.layout.store, step_dir(0), "train.arrow")
    assert [(s.index, s.reward, s.tokens) for s in trained] == [
        (s.index, s.reward, s.tokens) for s in saved]
    with pytest.raises(FileNotFoundError, match="rollout.debug_rollout_data"):
        mgr.generate(1)


def test_debug_modes_are_validated(make_config):
    with pytest.raises(ValueError, match="debug_rollout_data"):
        make_config("dbg", "rollout.debug_train_only=true")
    with pytest.raises(ValueError, match="exclude"):
        make_config("dbg", "rollout.debug_train_only=true", "rollout.debug_rollout_only=true",
            "rollout.debug_rollout_data=x")


def test_null_trainer_never_moves_the_weights(make_config):
    cfg = make_config("dbg", "rollout.debug_rollout_only=true")
    trainer = NullTrainActor(cfg)
    assert trainer.train_step(0)["skipped"] == 1.0
    assert trainer.version() == 0 and trainer.ensure_version(3)["version"] == 0
    assert trainer.weights() == {} and trainer.trained_indices() == []
