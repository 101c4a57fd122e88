"""A trainer rebuilt after the run's config changed replays each committed step under the
settings it was trained under, so it gets back the weights the run had, and trains the
steps after them under the new settings (a changed `train.lr` counts after a checkpoint load
too). What it cannot switch back to (settings fixed when a backend is built) it reports."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.train.step_settings import StepSettings, settings_for_replay
from engines.train.train_actor import TrainActor
from flows.config.run import RollflowConfig
from flows.replay import ReplayPlan, warn_of_other_settings  # (imports Prefect: before caplog)
from storage.batch_io import write_samples
from storage.run_layout import RunLayout, step_dir
from tasks.records import TrainRecord
from tests.support.samples import make_samples

# A run whose trainer settings change between its steps (the same run, configured again).
SETTINGS = ("train.lr=1e-3", "train.lr_decay_style=linear", "train.seed=7",
            "train.num_steps_per_rollout=2")


def changed_run(make_config: Any, *overrides: str) -> RollflowConfig:
    return make_config("changed", *SETTINGS, *overrides, backend="embedded", unique=False)


def train_and_commit(trainer: TrainActor, cfg: RollflowConfig, k: int) -> dict[str, float]:
    """What the driver does for step k: train it, record the settings it trained under in
    its train record, commit it."""
    layout = trainer.layout
    write_samples(layout.store, make_samples(8, seed=k), step_dir(k), "train.arrow")
    metrics = trainer.train_step(k)
    settings = StepSettings.of(cfg)
    layout.save_train_settings(settings.to_json(), settings.digest())
    record = TrainRecord(metrics=metrics, settings=settings.digest())
    layout.save_task_record(k, TrainRecord.STAGE, record.to_json())
    layout.mark_committed(k)
    return metrics


def weights(trainer: TrainActor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.weights().items()}


def test_a_rebuild_after_a_config_change_replays_each_step_under_its_own_settings(
    make_config: Any
) -> None:
    first = changed_run(make_config, "rollout.num_rollout=4")
    trainer = TrainActor(first)
    train_and_commit(trainer, first, 0)
    trainer.save_checkpoint(0)
    for k in (1, 2):
        train_and_commit(trainer, first, k)
    run_had = weights(trainer)

    # the run is extended (its LR schedule stretches) with a higher lr: new actors
    # (a new seed and weight decay too: the checkpoint restores the random state, and the
    # replayed steps keep the weight decay they had)
    longer = changed_run(make_config, "rollout.num_rollout=6",
                    "train.lr=3e-3", "train.seed=8", "train.weight_decay=0.1")
    assert longer.train.lr_decay_steps == 12 and first.train.lr_decay_steps == 8
    rebuilt = TrainActor(longer)
    restored = rebuilt.ensure_version(3)
    assert restored == {"rebuilt": True, "version": 3, "replayed": [1, 2], "unrecorded": [],
                        "inexact": []}
    got = weights(rebuilt)
    assert all(torch.equal(got[k], run_had[k]) for k in run_had)

    # step 3 trains under the new settings: optimizer steps 6 and 7 of a 12-step decay from
    # 3e-3 (`lr` is their mean)
    metrics = train_and_commit(rebuilt, longer, 3)
    assert metrics["lr"] == pytest.approx(3e-3 * (1 - 6.5 / 12))


def test_steps_without_recorded_settings_replay_under_the_current_ones(
    make_config: Any
) -> None:
    """Steps without recorded settings replay under the current ones, and the driver warns."""
    cfg = changed_run(make_config)
    trainer = TrainActor(cfg)
    write_samples(trainer.layout.store, make_samples(8, seed=0), step_dir(0), "train.arrow")
    trainer.train_step(0)
    trainer.layout.mark_committed(0)
    restored = TrainActor(cfg).ensure_version(1)
    assert (restored["replayed"], restored["unrecorded"]) == ([0], [0])


def test_settings_fixed_when_the_trainer_is_built_are_kept_and_reported(
    make_config: Any
) -> None:
    recorded = StepSettings.of(changed_run(make_config,
                                      "algorithm.kl_coef=0.1", "train.lr=5e-4"))
    current = StepSettings.of(changed_run(make_config, "train.seed=8"))
    settings, lost = settings_for_replay(recorded, current)
    assert settings.train.lr == 5e-4 and settings.train.seed == 8
    assert settings.algorithm == current.algorithm  # the KL term needs a reference model
    assert lost == [
        "train.seed: 7 -> 8",
        "algorithm: needs a reference model this trainer was not built with, so the current "
        "algorithm section is used",
    ]
    # the other way round (a reference built, the step did not use one) is exact
    settings, lost = settings_for_replay(current, recorded)
    assert settings.algorithm == current.algorithm and lost == ["train.seed: 8 -> 7"]


def test_a_changed_lr_counts_after_a_resume_from_a_checkpoint(
    make_config: Any
) -> None:
    """The restored optimizer and scheduler states carry the rate, weight decay and betas they
    were saved with; the megatron backend always took the configured rate, and the torch
    backend now takes all three."""
    first = changed_run(make_config, "train.lr_decay_style=constant")
    trainer = TrainActor(first)
    train_and_commit(trainer, first, 0)
    trainer.save_checkpoint(0)
    raised = changed_run(make_config, "train.lr_decay_style=constant",
                    "train.lr=3e-3", "train.weight_decay=0.1", "train.adam_betas=[0.8,0.9]")
    resumed = TrainActor(raised)
    assert resumed.ensure_version(1)["replayed"] == []  # the checkpoint alone
    assert train_and_commit(resumed, raised, 1)["lr"] == pytest.approx(3e-3)
    group = resumed.backend.actor.optimizer.param_groups[0]
    assert (group["weight_decay"], tuple(group["betas"])) == (0.1, (0.8, 0.9))


def test_a_replay_names_the_steps_the_source_trained_under_other_settings(
    make_config: Any, tmp_path: Path, caplog
) -> None:
    """`rollflow replay` trains under the source's latest config plus `--set`: steps the
    source trained under another lr are named, with the key, so the user can set it back."""
    source = RunLayout.open(str(tmp_path / "runs"), "source")
    early = StepSettings.of(changed_run(make_config, "train.lr=2e-4"))
    late = StepSettings.of(changed_run(make_config, "train.lr=5e-5"))
    for k, settings in enumerate([early, early, late]):
        source.save_train_settings(settings.to_json(), settings.digest())
        source.save_task_record(k, TrainRecord.STAGE, {"settings": settings.digest()})
    with caplog.at_level(logging.WARNING, logger="flows.replay"):
        warn_of_other_settings(source, ReplayPlan("source", 1, 3, None, [0]), late.to_json())
    assert "train.lr: 0.0002 -> 5e-05 (steps [1])" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flows.replay"):
        warn_of_other_settings(source, ReplayPlan("source", 2, 3, None, [0, 1]), late.to_json())
    assert not caplog.records  # step 2 trained under the replay's settings
