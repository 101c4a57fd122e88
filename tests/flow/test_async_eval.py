"""Periodic evaluation in one-step off-policy mode, with a custom eval function: every
evaluated version is evaluated on engines holding exactly that version, although the next
step's generation overlaps training."""

from __future__ import annotations

import uuid

from flows.config.run import EvalDataset
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config


def test_async_mode_evaluates_every_interval_on_the_version_it_names(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    from flows.train import train

    cfg = arithmetic_config(
        run_name=f"async-eval-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=["rollout.num_rollout=4", "rollout.mode=one_step",
                   "rollout.max_staleness=1", "eval.eval_interval=1", "eval.before_train=true",
                   "eval.eval_function_path=tests.support.hooks:engine_versions"],
    )
    cfg.eval.datasets = [EvalDataset(name="test", path=arithmetic_data["test"],
                                     label_key="label", max_prompts=8)]
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1, 2, 3]
    evals = layout.evals()
    assert sorted(evals) == [0, 1, 2, 3, 4]
    for version, metrics in evals.items():
        assert metrics["eval/asked_version"] == version and metrics["eval/test/samples"] == 8
        assert metrics["eval/engines_min_version"] == metrics["eval/engines_max_version"] == version
    # steps 1..3 evaluated inside the step, between broadcast and commit
    for k in range(3):
        committed = layout.store.read_json(f"steps/{k:06d}", "COMMITTED")["committed_at"]
        evaluated = layout.store.fs.info(layout.store.path("eval", f"{k + 1:06d}.json"))
        assert evaluated["mtime"] <= committed
