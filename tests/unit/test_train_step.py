"""The shared train step (engines/train/step.py) against a model-free `StepModel`: what a
backend is asked to do, in which order, on which rows, and how its answers are summarised."""

from __future__ import annotations

import math

import pytest

from engines.train.step_model import MicroBatch
from tests.support.fakes import FakeModel, fake_train_step
from tests.support.samples import make_samples


def test_steps_follow_num_steps_per_rollout_and_cover_every_sample() -> None:
    model = FakeModel()
    metrics = fake_train_step(model, num_steps_per_rollout=3).train(make_samples(10), 0)
    rows = [[i for mb in mbs for i in mb.rows] for _, mbs in model.calls]
    assert [len(r) for r in rows] == [4, 4, 2] and metrics["num_optimizer_steps"] == 3.0
    assert sorted(i for r in rows for i in r) == list(range(10))


def test_a_rank_without_samples_runs_one_uncounted_stand_in() -> None:
    samples = make_samples(8)
    step = fake_train_step(FakeModel(dp_rank=2, dp_size=3))
    assert [mb.rows for mb in step.micro_batches(samples, [5, 1, 7])] == [[7]]
    assert step.micro_batches(samples, [5, 1]) == [MicroBatch([5], counted=False)]


def test_critic_steps_first_and_alone_during_critic_only_rollouts() -> None:
    model = FakeModel()
    step = fake_train_step(model, {"advantage_estimator": "ppo"}, num_critic_only_steps=1,
                 global_batch_size=4)
    metrics = step.train(make_samples(8), 0)
    assert [part for part, _ in model.calls] == ["critic", "critic"]
    assert "critic/value_loss" in metrics and metrics["num_optimizer_steps"] == 2.0
    assert ("critic", 8) in model.scored and model.version == 1
    step.train(make_samples(8), 1)
    assert [part for part, _ in model.calls[2:]] == ["critic", "actor", "critic", "actor"]


def test_summary_averages_a_key_over_the_steps_that_report_it() -> None:
    """A skipped step has no grad_norm: the mean is over the others, not a 0 in the mean."""
    model = FakeModel(skip=(0,))
    metrics = fake_train_step(model, global_batch_size=2).train(make_samples(8), 0)
    assert metrics["grad_norm"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert metrics["num_optimizer_steps"] == 4.0 and math.isfinite(metrics["loss"])


def test_lazy_old_log_probs_skip_the_first_steps_scoring() -> None:
    lazy, eager = FakeModel(), FakeModel(dp_size=2)
    fake_train_step(lazy, global_batch_size=4).train(make_samples(8), 0)
    fake_train_step(eager, global_batch_size=4).train(make_samples(8), 0)
    assert lazy.scored == [("policy", 4)]  # the first step's 4 come from its own forward
    assert eager.scored == [("policy", 4), ("policy", 4)]  # first step alone, then the rest
    with pytest.raises(RuntimeError, match="failed part-way"):
        lazy.version = -1
        fake_train_step(lazy).train(make_samples(8), 1)
