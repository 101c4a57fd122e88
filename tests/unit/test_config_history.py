"""A trainer rebuilt by replay that may not reproduce the run's weights is warned about,
naming the keys: steps without recorded settings replayed under a changed config, and
recorded settings the trainer could not switch to; changes that do not touch training and
steps replayed under their own settings are not."""

from __future__ import annotations

import logging

from flows.config.history import changed_training_keys, warn_if_replayed_under_changed_config
from flows.config.loader import dump_config
from storage.run_layout import RunLayout
from tests.support.configs import small_config


def cfg(num_rollout: int = 4, lr: float = 1e-4, plot: bool = True):
    return small_config(f"rollout.num_rollout={num_rollout}", f"train.lr={lr}",
                        f"logging.plot={str(plot).lower()}")


def test_a_replay_under_a_longer_run_or_new_lr_is_warned_about(tmp_path, caplog):
    layout = RunLayout.open(str(tmp_path), "run")
    layout.store.write_text(dump_config(cfg()), "configs", "000.yaml")
    layout.store.write_text(dump_config(cfg(plot=False)), "configs", "001.yaml")
    now = cfg(num_rollout=6, lr=2e-4, plot=False)
    assert changed_training_keys(layout, now) == [
        "train.lr: 0.0001 -> 0.0002", "rollout.num_rollout: 4 -> 6"]
    with caplog.at_level(logging.WARNING, logger="flows.config.history"):
        replayed_as_recorded = {"replayed": [0, 1], "unrecorded": [], "inexact": []}
        assert warn_if_replayed_under_changed_config(replayed_as_recorded, layout, now) == []
        assert not caplog.records  # each step replayed under its own settings
        old_run = {"replayed": [0, 1], "unrecorded": [0, 1], "inexact": []}
        warn_if_replayed_under_changed_config(old_run, layout, now)
    assert "replaying steps [0, 1]" in caplog.text and "rollout.num_rollout: 4 -> 6" in caplog.text


def test_settings_the_trainer_could_not_switch_to_are_warned_about(tmp_path, caplog):
    layout = RunLayout.open(str(tmp_path), "run")
    restored = {"replayed": [2], "unrecorded": [], "inexact": ["step 2: train.seed: 1 -> 2"]}
    with caplog.at_level(logging.WARNING, logger="flows.config.history"):
        assert warn_if_replayed_under_changed_config(restored, layout, cfg()) == [
            "step 2: train.seed: 1 -> 2"]
    assert "train.seed: 1 -> 2" in caplog.text


def test_changes_that_do_not_touch_training_are_not_named(tmp_path):
    layout = RunLayout.open(str(tmp_path), "run")
    layout.store.write_text(dump_config(cfg()), "configs", "000.yaml")
    assert changed_training_keys(layout, cfg(plot=False)) == []
    assert changed_training_keys(RunLayout.open(str(tmp_path), "fresh"), cfg()) == []
