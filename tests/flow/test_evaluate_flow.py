"""The `evaluate` flow re-scores a stored weight version of a finished run with fresh actors
(its own namespace): the trainer is rebuilt to that version, the engines get its weights,
and the scores equal the ones the run stored when it evaluated that version itself."""

from __future__ import annotations

import uuid

from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config

TEST_SET = "eval.datasets=[{{name: test, path: {}, temperature: 0.0}}]"


def test_evaluate_rebuilds_a_past_version_and_scores_it_as_the_run_did(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    from flows.evaluate import evaluate
    from flows.train import train

    test_set = TEST_SET.format(arithmetic_data["test"])
    cfg = arithmetic_config(
        run_name=f"evaluate-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=[test_set, "rollout.num_rollout=3", "eval.eval_interval=1"],
    )
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)

    def scores(metrics):
        return {k: v for k, v in (metrics or {}).items() if not k.endswith("seconds")}

    stored = scores(layout.eval_of(1))
    assert stored and stored != scores(layout.eval_of(3))  # versions score differently
    layout.store.delete("eval", "000001.json")
    result = evaluate(cfg, weight_version=1)
    assert result["weight_version"] == 1
    assert result["restored"]["version"] == 1 and result["restored"]["replayed"] == [0]
    assert scores(result["metrics"]) == stored == scores(layout.eval_of(1))


def test_after_a_config_change_each_step_is_replayed_under_the_settings_it_trained_under(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    """The steps' train records name the settings they trained under; a rebuild after the
    run was extended with a new lr replays the old steps under theirs, with nothing to warn
    about (the torch trainer's weights: tests/unit/test_replay_settings.py)."""
    from engines.train.step_settings import StepSettings
    from flows.evaluate import evaluate
    from flows.train import train

    cfg = arithmetic_config(
        run_name=f"changed-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=[TEST_SET.format(arithmetic_data["test"]), "rollout.num_rollout=2",
                   "train.lr_decay_style=linear"],
    )
    train(cfg)
    longer = arithmetic_config(
        run_name=cfg.storage.run_name, runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=[TEST_SET.format(arithmetic_data["test"]), "rollout.num_rollout=3",
                   "train.lr_decay_style=linear", "train.lr=2e-4"],
    )
    assert train(longer)["restored"]["version"] == 2  # (from the run's last checkpoint)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert [layout.train_settings_of(k) for k in range(3)] == [
        StepSettings.of(cfg).to_json(), StepSettings.of(cfg).to_json(),
        StepSettings.of(longer).to_json()]
    result = evaluate(longer, weight_version=1)
    assert result["restored"] == {
        "rebuilt": True, "version": 1, "replayed": [0], "unrecorded": [], "inexact": []}
