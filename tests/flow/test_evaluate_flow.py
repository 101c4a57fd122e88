"""The `evaluate` flow re-scores a stored weight version of a finished run with fresh actors
(its own namespace): the trainer is rebuilt to that version, the engines get its weights,
and the scores equal the ones the run stored when it evaluated that version itself."""

from __future__ import annotations

import uuid

from storage.run_layout import RunLayout
from tests.flow.configs import arithmetic_config


def test_evaluate_rebuilds_a_past_version_and_scores_it_as_the_run_did(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    from flows.evaluate import evaluate
    from flows.train import train

    test_set = f"eval.datasets=[{{name: test, path: {arithmetic_data['test']}, temperature: 0.0}}]"
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
