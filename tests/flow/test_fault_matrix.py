"""Faults through real flows (mock or torch trainers, real Ray and Prefect); each
records its row of the fault matrix printed at the end of the session (tests/conftest.py),
next to the rows of the other fault tests."""

from __future__ import annotations

import uuid

import pytest

from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from storage.sample import RewardError
from tests.support.configs import arithmetic_config


@pytest.fixture
def make(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path):
    def build(name: str, overrides: list[str], backend: str = "mock"):
        return arithmetic_config(
            run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
            data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
            backend=backend, overrides=["rollout.num_rollout=3", *overrides],
        )
    return build


def trained(cfg) -> list[tuple[int, float]]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return [(s.index, float(s.reward)) for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def hook(name: str) -> list[str]:
    return ["rollout.rm_type=null", f"rollout.custom_rm_path=tests.support.hooks:{name}"]


def test_a_nan_reward_fails_the_step_and_a_fixed_rerun_trains_what_it_should(make, fault_matrix):
    from flows.train import train

    reference = make("nan-ref", hook("reward_exact"))
    train(reference)
    cfg = make("nan", hook("reward_nan_after_step_0"))
    with pytest.raises(RewardError, match=r"reward_nan_after_step_0") as err:
        train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0]  # step 1 stored nothing
    assert not layout.store.exists("steps/000001/rollout.arrow")
    assert "line" in str(err.value)  # the prompt's line in the data file

    fixed = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"custom_rm_path": "tests.support.hooks:reward_exact"})})
    result = train(fixed)
    assert result["resumed_at"] == 1
    same = trained(fixed) == trained(reference)
    assert same
    fault_matrix.add("reward hook returns NaN (1 in 5, step 1)", "step 1 generate, as scored",
                     "step fails (RewardError naming hook, sample, line); fixed rerun resumes "
                     "at step 1", same)


def test_a_nan_gradient_skips_one_optimizer_step(make, fault_matrix):
    from flows.train import train

    engine_mock_torch = ["engine.backend=mock", "train.backend=torch", "train.save_interval=1"]
    reference = make("grad-ref", engine_mock_torch)
    train(reference)
    cfg = make("grad-nan", [*engine_mock_torch, "algorithm.loss_type=custom_loss",
                            "algorithm.custom_loss_function_path=tests.support.hooks:nan_grad_loss_once"])
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.step_metrics(0)["train/skipped_steps"] == 1.0
    assert all(layout.step_metrics(k)["train/skipped_steps"] == 0.0 for k in (1, 2))
    same = trained(cfg) == trained(reference)  # the mock engine's samples ignore the weights
    assert same
    fault_matrix.add("NaN gradient norm (one optimizer step)", "that step, before stepping",
                     "step skipped, counted in train/skipped_steps; run goes on", same)


def test_a_driver_lost_after_the_trainer_trained_a_step_records_that_training(
    make, arithmetic_data, fault_matrix
):
    """The driver dies while the train task runs: the (kept) trainer finished step 2, so it
    is at version 3, but the step recorded nothing. The rerun resumes at step 2 and keeps
    the trainer (no rebuild). Its train task records the step's losses, not
    `{"skipped": 1.0}`, and its before-training evaluation does not score the engines, which
    now hold version 3, as version 2."""
    from engines.cluster.actors import kill_run_actors
    from flows.train import train

    test_set = f"eval.datasets=[{{name: test, path: {arithmetic_data['test']}, temperature: 0.0}}]"
    reference = make("lost-ref", [test_set])
    train(reference)
    cfg = make("lost", [test_set, "cluster.keep_actors=true"])
    try:
        train(cfg)
        layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
        for name in ("COMMITTED", "metrics.json", "tasks/train.json"):  # step 2 as it was
            layout.store.delete("steps/000002", name)
        layout.store.delete("checkpoints")  # the last step's, written after its train task
        layout.store.delete("eval", "000003.json")
        result = train(cfg)
        assert result["resumed_at"] == 2
        assert result["restored"] == {"rebuilt": False, "version": 3, "replayed": []}
    finally:
        kill_run_actors(cfg)
    ref = RunLayout.open(reference.storage.uri, reference.storage.run_name)
    train_keys = [k for k in ref.step_metrics(2) if k.startswith("train/")
                  and not k.endswith(("seconds", "tokens_per_s"))]
    recorded = {k: layout.step_metrics(2).get(k) for k in train_keys}
    same = recorded == {k: ref.step_metrics(2)[k] for k in train_keys} and "train/loss" in recorded
    assert same, recorded
    assert layout.eval_of(2) is None  # version 2 is gone from every actor: not evaluated
    def scores(version, of):
        return {k: v for k, v in (of.eval_of(version) or {}).items() if not k.endswith("seconds")}

    assert scores(3, layout) == scores(3, ref) != {}
    assert trained(cfg) == trained(reference)
    fault_matrix.add("driver lost during the train task (trainer kept, step 2)",
                     "step 2 train, after the trainer trained it",
                     "rerun keeps the trainer at v3; step 2 records its training's metrics; no "
                     "evaluation of v2 under v3's weights", same)
